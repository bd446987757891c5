import pytest

from asyncrl.buffer.ratelimiter import RateLimiter


def test_min_size_blocks_samples_only_below_the_size():
    rl = RateLimiter.min_size(3)
    rl.insert(2)
    assert not rl.can_sample(1) and rl.can_insert(10**6)
    rl.insert(1)
    assert rl.can_sample(100)  # MinSize puts no bound on the ratio
    rl.delete(1)
    assert not rl.can_sample(1)  # back below the size: stage 1 again


def test_sample_to_insert_ratio_keeps_the_error_within_the_band():
    # spi 2, min size 2, error 4: min_diff = 2*2 - 4 = 0, max_diff = 8
    rl = RateLimiter.sample_to_insert_ratio(samples_per_insert=2.0, min_size_to_sample=2, error_buffer=4)
    assert (rl.min_diff, rl.max_diff) == (0.0, 8.0)
    assert not rl.can_sample(1)
    rl.insert(2)  # filling up to min size is always allowed
    assert rl.can_sample(4) and not rl.can_sample(5)  # diff = 4: sampling 5 would go below 0
    rl.insert(2)  # diff = 8
    assert not rl.can_insert(1)  # 10 > max_diff: inserts wait for samples
    rl.sample(2)  # diff = 6
    assert rl.can_insert(1)
    assert "diff=6" in rl.why_blocked()


def test_ratio_one_with_min_size_b_is_a_bounded_stream():
    b = 4
    rl = RateLimiter.sample_to_insert_ratio(1.0, b, error_buffer=b)
    inserted = 0
    while rl.can_insert(1):
        rl.insert(1)
        inserted += 1
    assert inserted == 2 * b  # at most 2B groups wait
    for _ in range(20):
        assert rl.can_sample(b)
        rl.sample(b)
        rl.delete(b)  # used once
        for _ in range(b):
            assert rl.can_insert(1)
            rl.insert(1)
        assert not rl.can_insert(1)


def test_bad_arguments_name_the_value_and_the_rule():
    with pytest.raises(ValueError, match=r"error_buffer \(0.5\) must be >= max\(1, samples_per_insert\) = 1.0"):
        RateLimiter.sample_to_insert_ratio(1.0, 1, 0.5)
    with pytest.raises(ValueError, match=r"samples_per_insert \(0\) must be > 0"):
        RateLimiter(0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"min_size_to_sample \(0\) must be >= 1"):
        RateLimiter.min_size(0)
    rl = RateLimiter.min_size(1)
    rl.insert(3)
    other = RateLimiter.min_size(1)
    other.load_state(rl.state())
    assert other.inserts == 3
    with pytest.raises(ValueError, match="min_size_to_sample"):
        RateLimiter.min_size(2).load_state(rl.state())
