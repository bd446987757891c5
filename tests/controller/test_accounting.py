import pytest

from asyncrl.controller.accounting import summarize
from asyncrl.wire.messages import BufferFinal, GeneratorFinal, LearnerFinal, RewardFinal


def finals(trained, trained_with_reuse=None, sampled=None, resampled=0):
    reuse = trained if trained_with_reuse is None else trained_with_reuse
    return {
        "generator-0": GeneratorFinal(generated=40, tokens=100, version=3, busy_s=1.0, wall_s=2.0),
        "reward-0": RewardFinal(received=40, forwarded=40),
        "buffer": BufferFinal(
            inserted=40,
            sampled=trained if sampled is None else sampled,
            resampled=resampled,
            dropped={"stale": 8},
            held=40 - 8 - trained,
            held_groups=1,
        ),
        "learner": LearnerFinal(trained=trained, trained_with_reuse=reuse, version=3, busy_s=1.0, wall_s=2.0),
    }


def test_use_once_ledger_reconciles_as_before():
    summary = summarize(finals(trained=24), wall_s=1.0, eval_before=0.0, eval_after=0.0)
    assert summary["reconciles"] and summary["trained_with_reuse"] == 24
    assert all(v == 0 for v in summary["unaccounted_by_link"].values())


def test_reused_samples_count_once_in_the_ledger_and_repeats_reconcile_beside_it():
    summary = summarize(
        finals(trained=24, trained_with_reuse=40, resampled=16), wall_s=1.0, eval_before=0.0, eval_after=0.0
    )
    assert summary["reconciles"] and summary["trained"] == 24 and summary["trained_with_reuse"] == 40
    assert all(v == 0 for v in summary["unaccounted_by_link"].values())
    lost_repeat = summarize(finals(trained=24, trained_with_reuse=36, resampled=16), 1.0, 0.0, 0.0)
    assert lost_repeat["unaccounted_by_link"]["buffer->learner (with reuse)"] == 4


def test_versions_per_sample_counts_each_number_of_versions_exactly():
    learner = finals(trained=24)
    learner["learner"].segments_hist = {"3": 2, "1": 20, "12": 1, "4": 1}
    summary = summarize(learner, 1.0, None, None)
    assert summary["versions_per_sample"] == {"1": 20, "2": 0, "3": 2, "4": 1, "12": 1}
    assert list(summary["versions_per_sample"]) == ["1", "2", "3", "4", "12"]  # numeric order, not text
    assert summarize(finals(trained=24), 1.0, None, None)["versions_per_sample"] == {"1": 0, "2": 0}


def test_a_final_report_of_a_field_its_role_does_not_declare_fails_at_the_sender():
    with pytest.raises(TypeError, match="trainedd"):
        LearnerFinal(version=3, trainedd=24)
    with pytest.raises(AttributeError):
        _ = RewardFinal(received=1, forwarded=1).generated  # a generator's count, not a reward worker's
