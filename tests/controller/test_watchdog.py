import pytest

from asyncrl.config import load_config
from asyncrl.controller.watchdog import StallWatch


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def watch(clock, factor=5, floor_s=120, cap_s=3600, first_s=900):
    return StallWatch(factor=factor, floor_s=floor_s, cap_s=cap_s, first_s=first_s, clock=clock)


def test_a_33_s_step_of_a_real_model_neither_warns_nor_stalls():
    clock = Clock()
    w = watch(clock)
    for step in range(1, 5):  # 20-33 s per step, as a 0.36 B model took on two cores
        clock.now += 20 + 13 * (step % 2)
        assert w.state() == "ok", (step, w.waited())
        w.progress()
    assert w.slowest == 33
    clock.now += 33  # as slow as the slowest seen: no warning
    assert w.state() == "ok"
    clock.now += 34  # 67 s: past twice the slowest
    assert w.state() == "warn"


def test_the_bound_follows_the_slowest_interval_within_floor_and_cap():
    clock = Clock()
    w = watch(clock)
    assert w.bound() == 900  # nothing measured: the first-step bound
    clock.now = 10
    w.progress()
    assert w.bound() == 120  # 5 x 10 s is below the floor
    clock.now += 100
    w.progress()
    assert w.bound() == 500  # 5 x 100 s
    clock.now += 10
    w.progress()
    assert w.bound() == 500  # a fast step does not shrink it: slow steps recur
    clock.now += 2000
    w.progress()
    assert w.bound() == 3600  # capped: a hung run is still stopped


def test_a_hung_learner_is_stalled_once_past_the_bound():
    clock = Clock()
    w = watch(clock)
    clock.now = 60
    w.progress()  # one 60 s step: bound 300 s, warning after 120 s
    clock.now += 119
    assert w.state() == "ok"
    clock.now += 2
    assert w.state() == "warn"
    clock.now += 180
    assert w.state() == "stalled" and w.waited() > w.bound() == 300


def test_a_restart_resets_the_clock_without_measuring_a_step():
    clock = Clock()
    w = watch(clock)
    clock.now = 30
    w.progress()
    clock.now = 500  # a restore took 470 s: not a step's duration
    w.progress(measure=False)
    assert w.slowest == 30 and w.waited() == 0


def test_scaled_waits_grow_with_what_was_measured():
    w = watch(Clock())
    assert w.scaled(None, floor_s=60) == 60
    assert w.scaled(4.0, floor_s=60) == 60  # 5 x 4 s
    assert w.scaled(30.0, floor_s=60) == 150
    assert w.scaled(10_000.0, floor_s=60) == 3600


def test_bad_bounds_are_refused_by_name():
    with pytest.raises(ValueError, match=r"factor \(0.5\) must be >= 1"):
        watch(Clock(), factor=0.5)
    with pytest.raises(ValueError, match=r"floor_s \(100\) must be > 0 and <= cap_s \(10\)"):
        watch(Clock(), floor_s=100, cap_s=10)
    with pytest.raises(ValueError, match=r"run.stall_cap_s \(60.0\) must be >= run.stall_timeout_s \(120\)"):
        load_config(None, ["run.stall_cap_s=60"])


def test_start_up_is_given_time_per_gib_of_weights(tmp_path):
    from asyncrl.controller.preparation import startup_bound

    cfg = load_config(None, ["run.startup_timeout_s=300", "run.startup_s_per_gib=60"])
    assert startup_bound(cfg, tmp_path / "none") == 300  # a simulated run: no weights
    with open(tmp_path / "model.safetensors", "wb") as f:  # 14 GiB, sparse: a 7 B model in bf16
        f.truncate(14 << 30)
    (tmp_path / "config.json").write_text("{}")
    assert startup_bound(cfg, tmp_path) == 300 + 60 * 14
