from asyncrl.learner.worker import _count_first_time
from tests.factories import make_group


def test_first_time_samples_are_counted_once_by_uid_and_forgotten_past_the_staleness_bound():
    seen = {}
    a, b = make_group("a", version=0), make_group("b", version=1)
    assert _count_first_time([a, b], seen, version=1, max_staleness=2) == 8
    assert _count_first_time([a], seen, version=2, max_staleness=2) == 0  # a repeat
    assert _count_first_time([b], seen, version=4, max_staleness=2) == 0
    assert set(seen) == {1}  # version 0 is 4 behind: its groups are gone from the buffer
