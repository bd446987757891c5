"""The zero-variance filter: which groups it drops, how the buffer accounts for them, and that
its counts survive a snapshot."""

import pytest

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.observer import BufferMetrics
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.buffer.zero_variance import MAX_REWARD_LABELS, ZeroVarianceFilter
from asyncrl.config import load_config
from asyncrl.observability import metrics as m
from tests.factories import make_group


def with_parts(group, name, values):
    for s, v in zip(group.samples, values):
        if v is not None:
            s.reward_parts[name] = v
    return group


def test_a_group_whose_answers_all_score_alike_is_filtered_and_counted_by_that_reward():
    f = ZeroVarianceFilter()
    assert f.filters(make_group("g0", rewards=[1.0] * 4))
    assert f.filters(make_group("g1", rewards=[0.0] * 4))
    assert f.filters(make_group("g2", rewards=[0.0] * 4))
    assert not f.filters(make_group("g3", rewards=[1.0, 1.0, 1.0, 0.0]))
    assert f.report() == {"groups": 3, "samples": 12, "by_reward": {"1": 1, "0": 2}, "unmeasured": 0}


def test_the_default_tolerance_is_exact_and_a_tolerance_also_takes_near_ties():
    near = [0.5, 0.5 + 1e-12, 0.5, 0.5]
    assert not ZeroVarianceFilter().filters(make_group("g0", rewards=near))  # verl: std > 0 is kept
    assert ZeroVarianceFilter(tolerance=1e-6).filters(make_group("g0", rewards=near))
    assert not ZeroVarianceFilter(tolerance=0.1).filters(make_group("g1", rewards=[0.0, 1.0, 0.0, 1.0]))  # std 0.5
    with pytest.raises(ValueError, match=r"tolerance \(-1.0\) must be >= 0"):
        ZeroVarianceFilter(tolerance=-1.0)


def test_a_one_sample_group_is_kept_as_in_verl():
    assert not ZeroVarianceFilter().filters(make_group("g0", n=1, rewards=[1.0]))


def test_a_named_reward_is_looked_at_instead_of_the_combined_one():
    f = ZeroVarianceFilter(reward="exact_match")
    # Combined rewards differ (a format reward), exact match is 1 everywhere: no signal from correctness.
    group = with_parts(make_group("g0", rewards=[1.5, 1.0, 1.5, 1.0]), "exact_match", [1.0] * 4)
    assert f.filters(group)
    varied = with_parts(make_group("g1", rewards=[1.0] * 4), "exact_match", [1.0, 0.0, 1.0, 1.0])
    assert not f.filters(varied)


def test_a_group_lacking_the_named_reward_is_kept_and_counted_unmeasured():
    f = ZeroVarianceFilter(reward="exact_match")
    group = with_parts(make_group("g0", rewards=[1.0] * 4), "exact_match", [1.0, 1.0, None, 1.0])
    assert not f.filters(group)
    assert f.report()["unmeasured"] == 1 and f.report()["groups"] == 0


def test_shared_rewards_past_the_label_cap_count_as_other():
    f = ZeroVarianceFilter()
    for i in range(MAX_REWARD_LABELS + 3):
        assert f.filters(make_group(f"g{i}", n=2, rewards=[float(i)] * 2))
    by_reward = f.report()["by_reward"]
    assert len(by_reward) == MAX_REWARD_LABELS + 1 and by_reward["other"] == 3


def test_the_buffer_drops_filtered_groups_with_their_reason_and_reconciles():
    observer = BufferMetrics()
    buf = ReplayBuffer.from_config(BufferConfig(zero_variance={"drop": True}), observer=observer)
    before = m.DROPPED.labels("zero_variance")._value.get()  # the service exports buf.dropped
    metric_before = m.ZERO_VARIANCE_GROUPS.labels("1")._value.get()
    assert buf.insert(make_group("g0", rewards=[1.0] * 4)) is None
    assert buf.insert(make_group("g1", rewards=[1.0, 0.0, 1.0, 0.0])) is not None
    assert buf.dropped == {"zero_variance": 4} and buf.dropped_groups == 1  # it frees its dispatcher slot
    assert observer.dropped_ids == ["g0"]  # reported by id in the status: the dispatcher refills
    assert buf.reconcile()["held"] == 4
    assert m.ZERO_VARIANCE_GROUPS.labels("1")._value.get() == metric_before + 1
    assert m.DROPPED.labels("zero_variance")._value.get() == before  # the service's publish adds it, not the filter


def test_the_ledger_gets_the_drop_with_its_reason():
    lines = []

    class Ledger:
        def write(self, event, groups=None, **fields):
            lines.append((event, groups, fields))

    buf = ReplayBuffer.from_config(BufferConfig(zero_variance={"drop": True}), observer=BufferMetrics(Ledger()))
    buf.insert(make_group("g7", rewards=[0.0] * 4))
    assert lines == [("dropped", ["g7"], {"reason": "zero_variance"})]


def test_other_reasons_come_first_and_the_filter_is_off_by_default():
    buf = ReplayBuffer.from_config(BufferConfig(zero_variance={"drop": True}, max_staleness=1))
    buf.set_learner_version(5)
    buf.insert(make_group("g0", version=0, rewards=[1.0] * 4))
    assert buf.dropped == {"stale": 4} and buf.zero_variance.report()["groups"] == 0
    buf.insert(make_group("g1", version=5, rewards=[1.0] * 4))
    buf.insert(make_group("g1", version=5, rewards=[1.0, 0.0, 0.0, 0.0]))
    buf.insert(make_group("g1", version=5, rewards=[1.0, 0.0, 0.0, 0.0]))  # a copy of a stored group
    assert buf.dropped == {"stale": 4, "zero_variance": 4, "duplicate": 4}
    plain = ReplayBuffer.from_config(BufferConfig())
    assert plain.zero_variance is None and plain.insert(make_group("g0", rewards=[1.0] * 4)) is not None


def test_the_counts_travel_in_the_snapshot_and_count_on_after_a_restore(tmp_path):
    cfg = BufferConfig(zero_variance={"drop": True})
    buf = ReplayBuffer.from_config(cfg)
    buf.insert(make_group("g0", rewards=[1.0] * 4))
    buf.insert(make_group("g1", rewards=[0.0] * 4))
    buf.insert(make_group("g2", rewards=[0.0, 1.0, 1.0, 1.0]))
    buf.snapshot(tmp_path / "snap")
    metric_before = m.ZERO_VARIANCE_GROUPS.labels("0")._value.get()
    restored = ReplayBuffer.from_config(cfg)
    restored.restore(tmp_path / "snap")
    assert restored.zero_variance.report() == buf.zero_variance.report()
    assert m.ZERO_VARIANCE_GROUPS.labels("0")._value.get() == metric_before + 1  # the new process counts on
    restored.insert(make_group("g3", rewards=[0.0] * 4))
    assert restored.zero_variance.report()["by_reward"] == {"1": 1, "0": 2}
    assert restored.dropped == {"zero_variance": 12} and restored.reconcile()["held"] == 4


def test_the_config_refuses_estimators_whose_alike_groups_carry_a_signal_and_unknown_rewards():
    load_config("configs/bench_pipeline.yaml", ["buffer.zero_variance.drop=true", "algorithm.adv_estimator=rloo"])
    with pytest.raises(ValueError, match=r"adv_estimator \('remax'\) gives a group"):
        load_config(
            "configs/bench_pipeline.yaml",
            ["buffer.zero_variance.drop=true", "algorithm.adv_estimator=remax", "generator.greedy_baseline=true"],
        )
    with pytest.raises(ValueError, match=r"buffer.zero_variance.reward \('acc'\) must name one of the run's rewards"):
        load_config(
            "configs/bench_pipeline.yaml", ["buffer.zero_variance.drop=true", "buffer.zero_variance.reward=acc"]
        )
    cfg = load_config("configs/bench_pipeline.yaml", ["buffer.zero_variance.reward=exact_match"])
    assert not cfg.buffer.zero_variance.drop and ReplayBuffer.from_config(cfg.buffer).zero_variance is None
