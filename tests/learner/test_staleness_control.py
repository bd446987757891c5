"""The staleness controller of ``buffer.max_staleness: auto``: its rule, its limits, its state,
and the figures it reads from a step's stats."""

import math

import pytest
from pydantic import ValidationError

from asyncrl.buffer.config import AutoStalenessConfig
from asyncrl.config import RunConfig
from asyncrl.learner.staleness_control import AutoStaleness, Signals, StalenessController, step_signals
from asyncrl.observability import metrics as m
from asyncrl.observability.step_stats import StepStats

# Limits of every test unless it says otherwise: kl_max 0.05 (healthy <= 0.025), ess_min 0.5
# (healthy >= 0.75).
CFG = dict(min=1, max=6, start=3, ess_min=0.5, kl_max=0.05, margin=0.5, raise_after=3, lower_after=1, decrease=0.5)


def controller(**over) -> StalenessController:
    return StalenessController(AutoStalenessConfig(**{**CFG, **over}))


def healthy(at: int) -> Signals:
    return Signals(ess=0.95, kl=0.01, staleness_max=at)


def test_healthy_steps_at_the_bound_raise_it_by_one_after_raise_after_of_them():
    c = controller()
    assert [c.observe(healthy(3)) for _ in range(2)] == [None, None] and c.bound == 3
    reason = c.observe(healthy(3))
    assert c.bound == 4 and reason.startswith("raise 3 -> 4: kl 0.01 <= 0.025, ess 0.95 >= 0.75 for 3 steps")
    # the count starts again: three more steps at the new bound for the next raise
    assert [c.observe(healthy(4)) for _ in range(2)] == [None, None] and c.bound == 4
    assert c.observe(healthy(4)) is not None and c.bound == 5


def test_a_breach_lowers_the_bound_multiplicatively_never_below_min():
    c = controller(start=6)
    assert c.observe(Signals(ess=0.9, kl=0.2, staleness_max=6)) == "lower 6 -> 3: kl 0.2 > 0.05"
    assert c.observe(Signals(ess=0.3, kl=0.001, staleness_max=3)) == "lower 3 -> 1: ess 0.3 < 0.5"
    assert c.observe(Signals(ess=0.1, kl=1.0, staleness_max=1)) is None and c.bound == 1  # at min: holds
    c = controller(start=2, decrease=0.9)
    c.observe(Signals(ess=0.9, kl=0.2, staleness_max=2))
    assert c.bound == 1  # ⌊2 · 0.9⌋ = 1: at least one lower


def test_the_band_between_margin_and_limit_holds_the_bound_and_resets_the_count():
    c = controller()
    c.observe(healthy(3))
    c.observe(healthy(3))
    # kl 0.04: within kl_max 0.05, outside the margin (0.025): hold, and the count is lost
    assert c.observe(Signals(ess=0.95, kl=0.04, staleness_max=3)) is None and (c.bound, c.healthy) == (3, 0)
    assert c.observe(Signals(ess=0.6, kl=0.01, staleness_max=3)) is None and c.healthy == 0  # ess in the band
    assert [c.observe(healthy(3)) for _ in range(3)][-1] is not None and c.bound == 4


def test_healthy_steps_below_the_bound_neither_count_nor_reset():
    c = controller()
    c.observe(healthy(3))
    for _ in range(10):  # the stalest sample 2 < bound 3: nothing measured at the bound
        assert c.observe(healthy(2)) is None
    assert (c.bound, c.healthy) == (3, 1)
    c.observe(healthy(3))
    assert c.observe(healthy(3)) is not None and c.bound == 4


def test_the_bound_stays_within_min_and_max_whatever_the_signals():
    c = controller()
    for _ in range(50):
        c.observe(healthy(c.bound))
    assert c.bound == 6  # max
    for _ in range(50):
        c.observe(Signals(ess=0.01, kl=5.0, staleness_max=c.bound))
    assert c.bound == 1  # min


def test_lower_after_asks_for_consecutive_breaches():
    c = controller(lower_after=2)
    bad = Signals(ess=0.9, kl=0.2, staleness_max=3)
    assert c.observe(bad) is None and c.bound == 3
    c.observe(healthy(3))  # a good step in between: the count of breaches starts again
    assert c.observe(bad) is None and c.bound == 3
    assert c.observe(bad) is not None and c.bound == 1


def test_state_round_trips_and_a_saved_bound_outside_the_limits_is_brought_within():
    c = controller()
    c.observe(healthy(3))
    c.observe(healthy(3))
    d = controller()
    d.load_state(c.state())
    assert d.state() == {"bound": 3, "healthy": 2, "breached": 0}
    assert d.observe(healthy(3)) is not None and d.bound == 4  # the count went on from 2
    d.load_state({"bound": 40})
    assert d.bound == 6


def stats(**measured) -> StepStats:
    return StepStats(version=1, loss=0.0, tokens=8, staleness_mean=0.0, staleness_max=0, **measured)


def test_step_signals_read_the_stalest_samples_kl_and_the_ess():
    s = step_signals(stats(behaviour_ess=0.8, behaviour_kl_by_staleness={0: 0.001, 2: 0.03, 1: 0.01}))
    assert s == Signals(ess=0.8, kl=0.03, staleness_max=2)
    assert step_signals(stats(behaviour_ess=math.nan, behaviour_kl_by_staleness={0: 0.1})) is None
    assert step_signals(stats()) is None  # a trainer that measured nothing


def test_auto_staleness_puts_the_bound_and_the_reason_in_the_step_and_the_metrics():
    auto = AutoStaleness(AutoStalenessConfig(**{**CFG, "raise_after": 1}))
    raises = m.STALENESS_BOUND_CHANGES.labels("raise")._value.get()
    out = stats(behaviour_ess=0.99, behaviour_kl_by_staleness={3: 0.0})
    auto.after_step(out)
    assert out.staleness_bound == 4 and out.staleness_bound_reason.startswith("raise 3 -> 4")
    assert m.STALENESS_BOUND.labels("learner")._value.get() == 4
    assert m.STALENESS_BOUND_CHANGES.labels("raise")._value.get() == raises + 1
    held = stats()
    auto.after_step(held)
    assert (held.staleness_bound, held.staleness_bound_reason) == (4, None)  # no signals: the bound holds


def test_auto_config_is_checked_with_the_value_and_the_rule():
    cfg = RunConfig(buffer={"max_staleness": "auto", "auto_staleness": {"min": 2, "max": 8, "start": 2}})
    assert cfg.buffer.auto and cfg.buffer.initial_staleness == 2 and cfg.buffer.staleness_ceiling == 8
    fixed = RunConfig(buffer={"max_staleness": 3})
    assert not fixed.buffer.auto and fixed.buffer.initial_staleness == fixed.buffer.staleness_ceiling == 3
    with pytest.raises(ValidationError, match=r"start \(9\) must be within \[min \(1\), max \(8\)\]"):
        AutoStalenessConfig(min=1, max=8, start=9)
    with pytest.raises(ValidationError, match="max_staleness"):
        RunConfig(buffer={"max_staleness": "sometimes"})
    # the lead must fit the lowest bound the controller can set
    RunConfig(buffer={"max_staleness": "auto", "auto_staleness": {"min": 2}}, dispatcher={"ahead_versions": 2})
    with pytest.raises(ValidationError, match=r"ahead_versions \(3\) must be <= buffer.auto_staleness.min \(2\)"):
        RunConfig(buffer={"max_staleness": "auto", "auto_staleness": {"min": 2}}, dispatcher={"ahead_versions": 3})
    with pytest.raises(ValidationError, match=r"auto_staleness.min \(1\) minus weights.staleness_margin \(1\)"):
        RunConfig(buffer={"max_staleness": "auto"}, weights={"schedule": "staleness"})


def test_the_bound_survives_the_learners_checkpoint(tmp_path):
    from asyncrl.learner.checkpoint_io import load_learner_part, save_learner_part
    from asyncrl.learner.mock_trainer import MockTrainer, MockTrainerConfig
    from asyncrl.learner.totals import Counters
    from asyncrl.rundir.ledger import GroupIdSet

    cfg = AutoStalenessConfig(**{**CFG, "raise_after": 2})
    healthy_at = dict(behaviour_ess=0.99, behaviour_kl_by_staleness={3: 0.0})
    auto, trainer = AutoStaleness(cfg), MockTrainer(MockTrainerConfig())
    auto.after_step(stats(**healthy_at))
    auto.after_step(stats(**healthy_at))  # raise 3 -> 4
    auto.after_step(stats(**{**healthy_at, "behaviour_kl_by_staleness": {4: 0.0}}))  # one of two towards 5
    save_learner_part(trainer, Counters(), GroupIdSet(), tmp_path / "with", auto)
    save_learner_part(trainer, Counters(), GroupIdSet(), tmp_path / "without")  # a run under a fixed bound
    resumed = AutoStaleness(cfg)
    load_learner_part(MockTrainer(MockTrainerConfig()), Counters(), tmp_path / "with", resumed)
    assert resumed.controller.state() == {"bound": 4, "healthy": 1, "breached": 0}
    # the resumed run goes on where the saved one stood: one more healthy step raises
    step = stats(**{**healthy_at, "behaviour_kl_by_staleness": {4: 0.0}})
    resumed.after_step(step)
    assert step.staleness_bound == 5
    started = AutoStaleness(cfg)
    load_learner_part(MockTrainer(MockTrainerConfig()), Counters(), tmp_path / "without", started)
    assert started.bound == cfg.start
