import math

import numpy as np
import pytest
from pydantic import ValidationError

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.replay import ReplayBuffer
from tests.factories import make_group


def scored(gid, version=0, n=4, rewards=(1.0, 0.0, 1.0, 0.0), length=3):
    return make_group(gid, n=n, version=version, rewards=list(rewards)[:n], length=length)


def buffer(**cfg) -> ReplayBuffer:
    return ReplayBuffer.from_config(BufferConfig(**{"capacity_samples": 64, "max_staleness": None, **cfg}))


def ids(batch) -> list[str]:
    return [g.group_id for g in batch.items]


def test_fifo_hands_out_oldest_groups_once():
    buf = buffer(sampler="fifo")
    for i in range(5):
        buf.insert(scored(f"g{i}"))
    assert ids(buf.sample(2)) == ["g0", "g1"]
    assert ids(buf.sample(5)) == ["g2", "g3", "g4"]
    assert len(buf.sample(1)) == 0
    assert buf.reconcile() == {
        "inserted": 20,
        "sampled": 20,
        "resampled": 0,
        "dropped": {},
        "held": 0,
        "held_groups": 0,
    }


def test_groups_are_atomic_in_batches_and_evictions():
    buf = buffer(capacity_samples=12, sampler="uniform")
    for i in range(5):  # 20 samples into room for 12: the two oldest groups go whole
        buf.insert(scored(f"g{i}"))
    assert buf.dropped == {"evicted": 8} and buf.dropped_groups == 2
    batch = buf.sample(3)
    assert sorted(ids(batch)) == ["g2", "g3", "g4"]
    for g in batch.items:
        assert [s.uid for s in g.samples] == [f"{g.group_id}/{i}" for i in range(4)]
    assert buf.reconcile()["dropped"] == {"evicted": 8}


def test_capacity_in_bytes_evicts_oldest_groups():
    per_group = 3 * 4 + 4 * 24  # prompt ids + 4 x (3 response ids + 3 logprobs)
    buf = buffer(capacity_bytes=2 * per_group)
    for i in range(3):
        buf.insert(scored(f"g{i}"))
    assert len(buf) == 2 and buf.storage.bytes == 2 * per_group and buf.dropped == {"evicted": 4}


def test_staleness_gate_drops_groups_older_than_the_bound():
    buf = buffer(max_staleness=2)
    buf.insert(scored("old", version=0))
    buf.insert(scored("ok", version=1))
    buf.set_learner_version(3)  # "old" is 3 versions behind: dropped
    assert not buf.can_sample(2)
    assert buf.dropped == {"stale": 4}
    assert ids(buf.sample(2)) == ["ok"]
    buf.insert(scored("late", version=0))  # arrives already too old: never stored
    assert buf.reconcile()["dropped"] == {"stale": 8}


def test_bad_input_is_rejected_and_counted_by_reason():
    buf = buffer(capacity_samples=8)
    unscored = make_group("u")
    unscored.unscored_reason = "reward_failed: TimeoutError"
    buf.insert(unscored)
    buf.insert(scored("a"))
    assert buf.insert(scored("a")) is None  # the same group twice (at-least-once delivery)
    assert buf.insert(make_group("big", n=9, rewards=[1.0] * 9)) is None  # more samples than the capacity
    assert buf.dropped == {"reward_failed: TimeoutError": 4, "duplicate": 4, "too_large": 9}
    assert len(buf) == 1 and buf.dropped_groups == 2  # a duplicate copy frees no admission slot
    assert buf.reconcile() == {
        "inserted": 21,
        "sampled": 0,
        "resampled": 0,
        "dropped": {"reward_failed: TimeoutError": 4, "duplicate": 4, "too_large": 9},
        "held": 4,
        "held_groups": 1,
    }


def test_reuse_counts_each_sample_once_and_retires_at_max_times_sampled():
    buf = buffer(max_times_sampled=2, sampler="fifo")
    buf.insert(scored("a"))
    buf.insert(scored("b"))
    first = buf.sample(1)
    assert ids(first) == ["a"] and first.first_time.tolist() == [True]
    # a trained group is no longer "held" in the ledger, though the buffer keeps it for reuse
    assert buf.reconcile() | {"dropped": None} == {
        "inserted": 8,
        "sampled": 4,
        "resampled": 0,
        "dropped": None,
        "held": 4,
        "held_groups": 1,
    }
    second = buf.sample(2)
    assert ids(second) == ["a", "b"] and second.first_time.tolist() == [False, True]
    assert ids(buf.sample(2)) == ["b"]  # "a" retired after its second hand-out
    assert len(buf) == 0 and buf.removed == {"max_times_sampled": 8}
    assert buf.reconcile() == {"inserted": 8, "sampled": 8, "resampled": 8, "dropped": {}, "held": 0, "held_groups": 0}


def test_a_trained_group_evicted_later_is_not_a_drop():
    buf = buffer(capacity_samples=8, max_times_sampled=None, sampler="fifo")
    buf.insert(scored("a"))
    buf.sample(1)
    buf.insert(scored("b"))
    buf.insert(scored("c"))  # evicts "a", already trained
    assert buf.dropped == {} and buf.removed == {"evicted": 4}
    assert buf.reconcile()["held"] == 8


def test_every_group_is_sampled_within_the_floor_bound():
    """Half the groups carry no signal (equal rewards: priority 0, lifted to the floor); with
    P_min = floor^α / Σ p^α, each batch draws a given group first with probability >= P_min, so
    all N groups are seen within K batches except with probability N(1 - P_min)^K <= 1e-3."""
    cfg = dict(max_times_sampled=None, alpha=0.6, priority_floor=0.01, seed=3)
    buf = buffer(capacity_samples=4 * 64, **cfg)
    for i in range(64):
        buf.insert(scored(f"g{i}", rewards=(1.0, 0.0, 1.0, 0.0) if i % 2 else (1.0, 1.0, 1.0, 1.0)))
    p = np.array([0.25 if i % 2 else 0.01 for i in range(64)]) ** 0.6
    p_min = p.min() / p.sum()
    k = math.ceil(math.log(1e-3 / 64) / math.log(1 - p_min))
    seen = set()
    for _ in range(k):
        seen.update(ids(buf.sample(4)))
    assert len(seen) == 64, (k, 64 - len(seen))


def test_long_answers_are_sampled_like_short_ones_with_the_same_rewards():
    buf = buffer(capacity_samples=10**5, capacity_bytes=1 << 30, max_times_sampled=None, seed=1)
    for i in range(20):
        buf.insert(scored(f"{'long' if i % 2 else 'short'}{i}", length=2000 if i % 2 else 3))
    long_draws = sum(g.group_id.startswith("long") for _ in range(2000) for g in buf.sample(1).items)
    assert abs(long_draws - 1000) < 4 * math.sqrt(2000 * 0.25)  # within 4 sigma of 1/2


def test_priority_updates_apply_to_stored_groups_and_ignore_gone_ones():
    buf = buffer(capacity_samples=8, max_times_sampled=None, alpha=1.0, priority_floor=1e-3)
    key_a = buf.insert(scored("a"))
    key_b = buf.insert(scored("b"))
    buf.insert(scored("c"))  # evicts "a": its key now names nothing
    assert buf.update_priorities([key_a, key_b], [0.9, 0.1]) == 1
    assert buf.priority_updates_ignored == 1
    slot_b = key_b % buf.storage.max_items
    assert buf.sampler.priorities(np.array([slot_b])).tolist() == pytest.approx([0.1])
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        buf.update_priorities([key_b], [math.nan])
    with pytest.raises(ValueError, match="2 priorities given for 1 items"):
        buf.update_priorities([key_b], [0.1, 0.2])


def test_recency_decay_ages_priorities_with_the_learner_version():
    buf = buffer(max_times_sampled=None, alpha=1.0, priority_floor=1e-4, recency_decay=0.5)
    buf.insert(scored("old", version=0))
    buf.set_learner_version(2)
    buf.insert(scored("new", version=2))
    p = buf.sampler.priorities(buf.storage.oldest(2))
    assert p.tolist() == pytest.approx([0.25 * 0.25, 0.25])  # 0.5^2 for the two versions "old" is behind


def test_ratio_one_fifo_streams_every_group_exactly_once_in_order():
    buf = buffer(sampler="fifo", samples_per_insert=1.0, min_size_to_sample=2, error_buffer=2)
    arrived, trained = 0, []
    for _ in range(30):
        while buf.can_insert() and arrived < 40:
            buf.insert(scored(f"g{arrived:02d}"))
            arrived += 1
        assert len(buf) <= 4  # at most 2B waiting
        if buf.can_sample(2):
            trained += ids(buf.sample(2))
    assert trained == [f"g{i:02d}" for i in range(40)]


def test_config_combinations_are_checked():
    with pytest.raises(ValidationError, match=r"samples_per_insert \(2.0\) must be <= max_times_sampled \(1\)"):
        BufferConfig(samples_per_insert=2.0)
    with pytest.raises(ValidationError, match=r"error_buffer \(0.5\) must be >= max\(1, samples_per_insert\)"):
        BufferConfig(samples_per_insert=1.0, error_buffer=0.5)
    with pytest.raises(ValidationError, match=r"beta_final \(0.2\) must be >= beta \(0.4\)"):
        BufferConfig(beta_final=0.2)
    with pytest.raises(ValidationError, match="priority_flor"):
        BufferConfig(priority_flor=0.1)
    assert BufferConfig().sampler == "prioritized"


def test_drop_truncated_refuses_groups_with_an_answer_cut_at_the_length_limit():
    """``algorithm.truncation.mode: drop``: such a group is dropped on arrival under the reason
    ``truncated``, reported to the ledger hook (and so the dispatcher), and every sample reconciles."""

    class Observer:
        def __init__(self):
            self.dropped = []

        def on_insert(self, priorities): ...
        def on_sample(self, age_versions, age_s, samples): ...
        def on_remove(self, reason, samples): ...

        def on_drop_groups(self, group_ids, reason):
            self.dropped.append((group_ids, reason))

    observer = Observer()
    buf = ReplayBuffer.from_config(BufferConfig(capacity_samples=64), observer=observer, drop_truncated=True)
    cut = scored("cut")
    cut.samples[2].finish_reason = "length"
    assert buf.insert(cut) is None
    assert buf.insert(scored("whole")) is not None
    assert buf.dropped == {"truncated": 4} and buf.dropped_groups == 1
    assert observer.dropped == [(["cut"], "truncated")]
    assert buf.reconcile()["inserted"] == 8 and buf.reconcile()["held"] == 4
    # without the flag (every other truncation mode) the same group is stored
    keep = buffer()
    assert keep.insert(cut) is not None and not keep.dropped
