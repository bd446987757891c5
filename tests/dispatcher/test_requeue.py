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
