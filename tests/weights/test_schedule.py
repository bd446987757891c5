import pytest

from asyncrl.weights import BroadcastSchedule, WeightSyncConfig


def _published(schedule, steps, clock=None, dt=0.0):
    out = []
    for v in range(1, steps + 1):
        if clock is not None:
            clock[0] += dt
        if schedule.due(v):
            schedule.published(v)
            out.append(v)
    return out


def test_every_k_and_the_last_step():
    s = BroadcastSchedule(WeightSyncConfig(schedule="every_k"), every_k=3, max_staleness=4, total_steps=10)
    assert _published(s, 10) == [3, 6, 9, 10]


def test_every_s_uses_the_clock():
    clock = [0.0]
    s = BroadcastSchedule(WeightSyncConfig(schedule="every_s", every_s=2.5), 1, None, 100, clock=lambda: clock[0])
    assert _published(s, 10, clock, dt=1.0) == [3, 6, 9]


def test_staleness_publishes_just_in_time():
    s = BroadcastSchedule(
        WeightSyncConfig(schedule="staleness", staleness_margin=0), 1, max_staleness=4, total_steps=100
    )
    assert _published(s, 12) == [4, 8, 12]
    # with the bound, every sample in flight (stamped <= last published) stays admissible:
    s = BroadcastSchedule(
        WeightSyncConfig(schedule="staleness", staleness_margin=1), 1, max_staleness=4, total_steps=100
    )
    published = [0] + _published(s, 30)
    assert all(b - a + 1 <= 4 for a, b in zip(published, published[1:]))


def test_staleness_bound_must_leave_room():
    with pytest.raises(ValueError, match="max_staleness"):
        BroadcastSchedule(
            WeightSyncConfig(schedule="staleness", staleness_margin=2), 1, max_staleness=2, total_steps=10
        )


def test_a_bound_moved_while_running_moves_the_staleness_schedule():
    s = BroadcastSchedule(
        WeightSyncConfig(schedule="staleness", staleness_margin=1), 1, max_staleness=4, total_steps=100
    )
    assert _published(s, 6) == [3, 6]
    s.set_max_staleness(2)  # lowered under auto: publish every step (2 - 1)
    assert _published(s, 9)[-3:] == [7, 8, 9]
    with pytest.raises(ValueError, match=r"max_staleness \(1\) minus weights.staleness_margin \(1\)"):
        s.set_max_staleness(1)
