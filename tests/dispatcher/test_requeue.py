"""The dispatcher's record of outstanding groups: what a failure sends out again, and checkpoints."""

import json

import pytest

from asyncrl.dispatcher.admission import Admission
from asyncrl.dispatcher.checkpoint import restore_dispatcher, save_dispatcher
from asyncrl.dispatcher.cursor import PromptCursor
from asyncrl.dispatcher.outstanding import Outstanding
from asyncrl.rundir.ledger import GroupIdSet
from asyncrl.tasks.prompts import Prompt


def rows(*seqs):
    return [{"group_id": f"g{s:08d}", "prompt_uid": f"p{s}", "text": "1+1=", "answer": "2", "task": "t"} for s in seqs]


def outstanding_with(now=0.0):
    o = Outstanding(lease_s=10.0)
    for row in rows(0, 1):
        o.dispatched(row, "generator-0", now)
    for row in rows(2, 3):
        o.dispatched(row, "generator-1", now)
    o.settle(inserted=["g00000001", "g00000003"])
    return o


def queued(o):
    return sorted(r["group_id"] for r in o.again)


def test_a_dead_generator_sends_out_again_only_its_groups_not_yet_in_the_buffer():
    o = outstanding_with()
    assert o.requeue("generator", "generator-0") == 1 and queued(o) == ["g00000000"]
    assert o.requeue("generator", "generator-0") == 0  # already queued: not twice


def test_a_dead_reward_worker_sends_out_every_group_not_yet_in_the_buffer():
    o = outstanding_with()
    assert o.requeue("in_flight") == 2 and queued(o) == ["g00000000", "g00000002"]


def test_a_dead_buffer_sends_out_everything_not_trained_or_dropped():
    o = outstanding_with()
    o.settle(trained=[[1, ["g00000001"]]], dropped=["g00000002"])
    assert o.requeue("buffered") == 2 and queued(o) == ["g00000000", "g00000003"]


def test_a_queued_group_settled_meanwhile_is_not_sent_again():
    o = outstanding_with()
    assert o.requeue("buffered") == 4  # the buffer died: everything not trained goes out again
    o.settle(inserted=["g00000000"])  # its original was on its way and reached the new buffer
    o.settle(trained=[[1, ["g00000001"]]])
    o.settle(dropped=["g00000002"])
    assert [r["group_id"] for r in o.take_again(8)] == ["g00000003"]
    assert o.passed_over == 3 and not o.again
    assert o.requeue("buffered") == 2  # what reached the buffer can be lost with it again


def test_an_expired_lease_sends_a_group_out_again():
    o = outstanding_with(now=0.0)
    assert o.requeue("expired", now=5.0) == 0
    assert o.requeue("expired", now=11.0) == 2  # the two never seen by the buffer
    assert o.requeue("expired", now=1000.0) == 0  # queued ones do not expire again


def test_trained_groups_are_kept_until_a_checkpoint_holds_them():
    o = outstanding_with()
    o.settle(trained=[[4, ["g00000001"]], [6, ["g00000003"]]])
    assert {r["group_id"] for r in o.to_checkpoint(version=5)} == {"g00000000", "g00000002", "g00000003"}
    o.forget_trained(5)
    assert "g00000001" not in o.entries and "g00000003" in o.entries


def test_dispatcher_checkpoint_round_trip_sends_out_what_no_other_part_holds(tmp_path):
    prompts = [Prompt(prompt_uid=f"p{i}", text=f"{i}+1=", answer=str(i + 1), task="t") for i in range(10)]
    cursor, admission = PromptCursor(prompts, seed=0, epochs=None), Admission(batch_groups=2, max_staleness=4)
    cursor.take(4)
    admission.dispatched, admission.version = 4, 3
    o = outstanding_with()
    o.settle(trained=[[2, ["g00000002"]], [3, ["g00000000"]]])
    ckpt = tmp_path / "v3"
    (ckpt / "buffer").mkdir(parents=True)
    (ckpt / "learner").mkdir()
    admission.count_trained(2, 1)  # version 2 trained one group of two
    admission.count_trained(4, 0)  # after the checkpoint: not in it
    save_dispatcher(ckpt / "dispatcher.json", cursor, admission, o, version=2)
    (ckpt / "buffer" / "buffer_ids.json").write_text(json.dumps(["g00000001"]))
    trained = GroupIdSet()
    trained.add("g00000002")
    (ckpt / "learner" / "trained_ids.bin").write_bytes(trained.to_bytes())

    cursor2, admission2, o2 = PromptCursor(prompts, seed=0, epochs=None), Admission(2, 4), Outstanding()
    out = restore_dispatcher(ckpt, cursor2, admission2, o2)
    # g0 was trained at version 3 > 2 (the learner part lacks it), g3 was in flight: both again;
    # g1 is in the buffer part and g2 in the learner part.
    assert queued(o2) == ["g00000000", "g00000003"] and out["again"] == 2
    assert (cursor2.epoch, cursor2.index, admission2.dispatched) == (cursor.epoch, cursor.index, 4)
    assert [p.prompt_uid for p in cursor2.take(3)] == [p.prompt_uid for p in cursor.take(3)]
    assert admission2.short_before == 1  # the step to version 2 lacked a group; version 4 is trained anew


def test_without_checkpoints_trained_groups_are_forgotten_at_once():
    o = Outstanding(keep_trained=False)
    o.dispatched(rows(0)[0], "generator-0", 0.0)
    o.settle(trained=[[1, ["g00000000"]]])
    assert o.entries == {}


def test_a_dropped_duplicate_copy_does_not_settle_its_group():
    from asyncrl.buffer.observer import BufferMetrics

    metrics = BufferMetrics()
    metrics.on_drop_groups(["g00000001"], "duplicate")
    metrics.on_drop_groups(["g00000002"], "stale")
    assert metrics.dropped_ids == ["g00000002"]


def test_a_group_frees_its_admission_slot_once_however_many_copies_are_dropped():
    o = outstanding_with()
    assert o.settle(dropped=["g00000000"]) == 1
    assert o.settle(dropped=["g00000000"]) == 0  # a second copy of it
    o.settle(trained=[[1, ["g00000001"]]])
    assert o.settle(dropped=["g00000001"]) == 0  # a copy of a trained group


def test_after_a_reward_worker_death_groups_still_upstream_get_a_grace_not_a_copy():
    o = Outstanding(lease_s=600.0, grace_s=5.0)
    for row in rows(0, 1, 2):
        o.dispatched(row, "generator-0", 0.0)
    o.settle(inserted=["g00000001"])
    assert o.requeue("in_flight", now=100.0) == 0 and not o.again  # g0, g2 may still be sampled
    o.settle(inserted=["g00000000"])  # g0 was: it reached the restarted reward worker, then the buffer
    assert o.requeue("expired", now=104.0) == 0
    assert o.requeue("expired", now=105.5) == 1 and queued(o) == ["g00000002"]  # g2 was lost with it


def test_after_a_buffer_death_what_it_held_goes_out_at_once_the_rest_after_the_grace():
    o = outstanding_with(now=45.0)
    o.grace_s = 5.0
    assert o.requeue("buffered", now=50.0) == 2 and queued(o) == ["g00000001", "g00000003"]
    assert o.requeue("expired", now=54.0) == 0  # g0, g2 may still reach the restarted buffer
    assert o.requeue("expired", now=55.5) == 2 and queued(o) == [f"g{s:08d}" for s in range(4)]


def test_a_grace_never_postpones_a_lease_due_sooner():
    o = Outstanding(lease_s=10.0, grace_s=5.0)
    o.dispatched(rows(0)[0], "generator-0", 0.0)
    o.requeue("in_flight", now=8.0)  # its lease runs out at 10, before the grace would (13)
    assert o.requeue("expired", now=10.5) == 1


def test_a_grace_needs_the_time_of_the_requeue():
    o = Outstanding(grace_s=5.0)
    o.dispatched(rows(0)[0], "generator-0", 0.0)
    with pytest.raises(ValueError, match="grace_s"):
        o.requeue("in_flight")


def dispatcher_of(admission, outstanding, prompts=20):
    """A dispatcher without sockets: enough for ``rows_for``."""
    from asyncrl.dispatcher.process import Dispatcher

    d = Dispatcher.__new__(Dispatcher)
    cursor = PromptCursor([Prompt(f"p{i}", f"{i}+1=", str(i + 1), "t") for i in range(prompts)], seed=0, epochs=None)
    d.cursor, d.admission, d.outstanding = cursor, admission, outstanding
    return d


def test_rows_queued_again_give_up_their_slots_and_go_out_again_within_the_budget():
    a, o = Admission(batch_groups=4, max_staleness=1), Outstanding()
    d = dispatcher_of(a, o)
    sent = d.rows_for(16, version=0)
    assert len(sent) == 8  # (1 + 0 + 1) * 4
    for row in sent:
        o.dispatched(row, "generator-0" if int(row["group_id"][1:]) < 4 else "generator-1", 0.0)
    assert o.requeue("generator", "generator-0") == 4 and len(o.unsent) == 4
    assert a.capacity(0, len(o.unsent)) == 4  # their slots are free until they go out again
    again = d.rows_for(16, version=0)
    assert [r["group_id"] for r in again] == [f"g{s:08d}" for s in range(4)]  # only again: the budget is full
    assert not o.unsent and a.capacity(0, 0) == 0


def test_a_queued_row_whose_original_turns_up_holds_its_slot_again():
    o = outstanding_with()
    o.requeue("in_flight")
    assert o.unsent == {"g00000000", "g00000002"}
    o.settle(inserted=["g00000000"], dropped=["g00000002"])
    assert not o.unsent  # one reached the buffer (its slot is taken), one was dropped (its slot freed by the drop)


def test_after_a_restore_what_goes_out_again_is_sent_as_the_budget_allows(tmp_path):
    prompts = [Prompt(prompt_uid=f"p{i}", text=f"{i}+1=", answer=str(i + 1), task="t") for i in range(40)]
    cursor, admission = PromptCursor(prompts, seed=0, epochs=None), Admission(batch_groups=2, max_staleness=1)
    o = Outstanding()
    for row in rows(*range(10)):  # version 1, then a checkpoint at version 1
        o.dispatched(row, "generator-0", 0.0)
    admission.dispatched = 10
    o.settle(trained=[[1, ["g00000000", "g00000001"]], [2, ["g00000002", "g00000003"]]], inserted=["g00000004"])
    ckpt = tmp_path / "v1"
    (ckpt / "buffer").mkdir(parents=True)
    (ckpt / "learner").mkdir()
    save_dispatcher(ckpt / "dispatcher.json", cursor, admission, o, version=1)
    (ckpt / "buffer" / "buffer_ids.json").write_text(json.dumps(["g00000004"]))
    trained = GroupIdSet()
    for gid in ("g00000000", "g00000001"):
        trained.add(gid)
    (ckpt / "learner" / "trained_ids.bin").write_bytes(trained.to_bytes())

    a2, o2 = Admission(2, 1), Outstanding()
    a2.short_before = 5  # from before the restore: the checkpoint's own count replaces it
    restore_dispatcher(ckpt, PromptCursor(prompts, seed=0, epochs=None), a2, o2)
    assert a2.short_before == 0
    # g2, g3 (trained at version 2 > 1) and g5..g9 (in flight) go out again: 7 rows, held back
    # to (1 + 1 + 1) * 2 = 6 slots less 2 trained and 1 in the buffer: 3 at once.
    assert len(o2.again) == 7 and len(o2.unsent) == 7
    assert len(dispatcher_of(a2, o2).rows_for(16, version=1)) == 3


def test_the_bound_set_under_auto_is_restored_with_the_dispatcher(tmp_path):
    prompts = [Prompt(prompt_uid=f"p{i}", text=f"{i}+1=", answer=str(i + 1), task="t") for i in range(4)]
    admission = Admission(batch_groups=2, max_staleness=4)
    admission.set_bound(7)
    ckpt = tmp_path / "v0"
    (ckpt / "buffer").mkdir(parents=True)
    (ckpt / "learner").mkdir()
    save_dispatcher(ckpt / "dispatcher.json", PromptCursor(prompts, seed=0, epochs=None), admission, Outstanding(), 0)
    (ckpt / "buffer" / "buffer_ids.json").write_text("[]")
    (ckpt / "learner" / "trained_ids.bin").write_bytes(GroupIdSet().to_bytes())
    cursor = PromptCursor(prompts, seed=0, epochs=None)
    auto, fixed = Admission(2, 4), Admission(2, 4)
    assert restore_dispatcher(ckpt, cursor, auto, Outstanding(), auto=True)["max_staleness"] == 7
    restore_dispatcher(ckpt, cursor, fixed, Outstanding())  # a fixed bound is the config's, not the checkpoint's
    assert (auto.max_staleness, auto.capacity(), fixed.max_staleness) == (7, 16, 4)
