import pytest

from asyncrl.dispatcher.admission import Admission
from asyncrl.dispatcher.cursor import PromptCursor
from asyncrl.tasks.prompts import Prompt


def test_admission_follows_the_staleness_budget():
    a = Admission(batch_groups=4, max_staleness=1)
    assert a.capacity() == 8  # (1 + 0 + 1) * 4
    a.dispatched = 8
    assert a.capacity() == 0
    a.update(version=1, dropped_groups=0)
    assert a.capacity() == 4  # (1 + 1 + 1) * 4 - 8
    a.update(version=1, dropped_groups=2)
    assert a.capacity() == 6  # dropped groups free their slots
    a.update(version=0, dropped_groups=2)  # the version never moves backwards
    assert a.capacity() == 6
    a.update(version=1, dropped_groups=1)  # a buffer restarted empty counts from 0: one more drop
    assert a.capacity() == 7


def test_after_a_restore_the_first_buffer_report_is_a_baseline():
    a = Admission(batch_groups=4, max_staleness=1)
    a.dropped = 10  # restored from the dispatcher's checkpoint, written after the buffer's
    a.update(version=2, dropped_groups=7)  # the restored buffer's snapshot count
    assert a.dropped == 10
    a.update(version=2, dropped_groups=9)
    assert a.dropped == 12


def test_groups_go_out_again_only_to_generators_with_recent_weights():
    a = Admission(batch_groups=4, max_staleness=2)
    a.update(version=10, dropped_groups=0)
    assert a.may_sample(8) and not a.may_sample(7) and not a.may_sample(0)
    assert Admission(batch_groups=4, max_staleness=None).may_sample(0)


def test_admission_counts_from_the_version_the_generator_serves():
    a = Admission(batch_groups=4, max_staleness=1)
    a.update(version=3, dropped_groups=0)
    a.dispatched = 12
    assert a.capacity() == 8  # (1 + 3 + 1) * 4 - 12
    assert a.capacity(version=2) == 4  # a generator still on version 2 may run less far ahead
    assert a.capacity(version=9) == 8  # no generator serves a version the learner has not made


def test_a_generator_behind_a_used_up_budget_is_told_to_reload():
    a = Admission(batch_groups=4, max_staleness=0)  # synchronous: one batch per version
    a.dispatched = 4
    assert not a.behind(0)  # the learner has not moved: waiting is right
    a.update(version=1, dropped_groups=0)
    assert a.behind(0) and a.capacity(0) == 0 and a.capacity(1) == 4
    assert not a.behind(1)


def test_no_staleness_bound_means_no_admission_limit():
    assert Admission(batch_groups=4, max_staleness=None).capacity() > 10**6


def test_admission_rejects_a_bad_batch_size():
    with pytest.raises(ValueError, match=r"batch_groups \(0\) must be >= 1"):
        Admission(batch_groups=0, max_staleness=1)


def test_cursor_covers_every_prompt_each_epoch_in_a_seeded_order():
    prompts = [Prompt(f"p{i}", f"{i}", "0", "addition") for i in range(5)]
    c = PromptCursor(prompts, seed=3, epochs=2)
    first = c.take(5)
    second = c.take(5)
    assert sorted(p.prompt_uid for p in first) == sorted(p.prompt_uid for p in prompts)
    assert sorted(p.prompt_uid for p in second) == sorted(p.prompt_uid for p in prompts)
    assert c.take(1) == []  # two epochs done
    again = PromptCursor(prompts, seed=3, epochs=2).take(5)
    assert [p.prompt_uid for p in again] == [p.prompt_uid for p in first]


def test_a_shorter_lead_admits_fewer_groups_and_keeps_the_whole_bound_to_train_them():
    a = Admission(batch_groups=4, max_staleness=4, ahead=1)
    assert a.capacity() == 8  # (1 + 0 + 1) * 4, not (4 + 0 + 1) * 4
    a.update(version=3, dropped_groups=0)
    assert a.capacity() == 20  # (1 + 3 + 1) * 4
    assert a.may_sample(0)  # 3 versions behind: beyond the lead (1), within max_staleness (4)


def test_a_lead_beyond_the_staleness_bound_is_refused():
    with pytest.raises(ValueError, match=r"ahead \(5\) must be in \[0, max_staleness \(4\)\]"):
        Admission(batch_groups=4, max_staleness=4, ahead=5)
    from asyncrl.config import load_config

    with pytest.raises(ValueError, match=r"dispatcher.ahead_versions \(5\) must be <= buffer.max_staleness \(4\)"):
        load_config(None, ["dispatcher.ahead_versions=5", "buffer.max_staleness=4"])
    assert load_config(None, ["dispatcher.ahead_versions=2"]).dispatcher.ahead_versions == 2


def test_a_publication_period_past_the_staleness_bound_is_refused_when_the_config_is_read():
    """At max_staleness 0 with a broadcast every 2 steps, after step 1 the learner (version 1) needs
    groups of version 1 while the generators serve 0: the rule admits none, and the run would wait
    for work forever. The config refuses it, naming both keys."""
    from asyncrl.config import load_config

    a = Admission(batch_groups=4, max_staleness=0)
    a.dispatched = 4  # step 1 trained the first 4
    a.update(version=1, dropped_groups=0)
    assert a.capacity(version=0) == 0 and not a.may_sample(0)  # served version 0: nothing to admit
    assert a.capacity(version=1) == 4  # had version 1 been published
    with pytest.raises(ValueError, match=r"learner.broadcast_every \(2\) must be <= buffer.max_staleness \(0\) \+ 1"):
        load_config(None, ["buffer.max_staleness=0", "learner.broadcast_every=2"])
    with pytest.raises(
        ValueError, match=r"learner.broadcast_every \(3\) must be <= buffer.auto_staleness.min \(1\) \+ 1"
    ):
        load_config(None, ["buffer.max_staleness=auto", "buffer.auto_staleness.min=1", "learner.broadcast_every=3"])
    assert load_config(None, ["buffer.max_staleness=0", "learner.broadcast_every=1"]).learner.broadcast_every == 1
    assert load_config(None, ["buffer.max_staleness=1", "learner.broadcast_every=2"]).learner.broadcast_every == 2
    every_s = load_config(None, ["buffer.max_staleness=0", "learner.broadcast_every=2", "weights.schedule=every_s"])
    assert every_s.weights.schedule == "every_s"  # publications by time: the period is not in steps


def test_a_step_that_trains_fewer_than_b_groups_is_charged_the_groups_it_lacks():
    a = Admission(batch_groups=4, max_staleness=1)
    a.dispatched = 8
    a.update(version=1, dropped_groups=0)
    assert a.capacity() == 4  # (1 + 1 + 1) * 4 - 8
    a.count_trained(1, 3)  # the learner refused a copy of a group it had trained: 3 groups, not 4
    assert a.capacity() == 3 and a.short() == 1
    a.count_trained(1, 3)  # the same report again
    a.count_trained(2, 4)
    assert a.short() == 1
    a.fold(1)  # a checkpoint at version 1 is committed
    assert (a.short_before, a.trained_by_version, a.short(upto=1)) == (1, {2: 4}, 1)


def test_a_bound_set_while_running_moves_the_budget_and_keeps_the_lead():
    a = Admission(batch_groups=4, max_staleness=1)
    a.dispatched = 8
    a.set_bound(3)  # raised: two more versions' groups may go out at once
    assert a.capacity() == 8 and a.may_sample(0)
    a.update(version=4, dropped_groups=0)
    a.set_bound(1)  # lowered: nothing more until the versions catch up; version 2 is too old now
    assert a.capacity() == (1 + 4 + 1) * 4 - 8 and not a.may_sample(2)
    led = Admission(batch_groups=4, max_staleness=4, ahead=1)
    led.set_bound(2)
    assert (led.ahead, led.max_staleness) == (1, 2)  # the lead stays: it is the smaller
    with pytest.raises(ValueError, match=r"max_staleness \(0\) must be >= 0 and >= ahead \(1\)"):
        led.set_bound(0)
