"""The group ledger: id sets, and the replay that finds lost and twice-trained groups."""

import json

from asyncrl.rundir.ledger import GroupIdSet, LedgerWriter, group_seq
from asyncrl.rundir.ledger_replay import reconcile_ledger


def test_group_id_set_holds_dispatcher_ids_as_bits_and_others_as_strings():
    ids = GroupIdSet()
    assert ids.add("g00000003") and not ids.add("g00000003")
    assert ids.add("g00100000") and ids.add("external-7")
    assert "g00000003" in ids and "g00000004" not in ids and "external-7" in ids and "g99999999" not in ids
    assert len(ids) == 3
    back = GroupIdSet.from_bytes(ids.to_bytes())
    assert len(back) == 3 and "g00100000" in back and "external-7" in back and "g00000002" not in back
    assert len(ids._bits) <= 100_000 // 8 * 2  # an eighth of a byte per group, doubling growth
    assert group_seq("g00000042") == 42 and group_seq("x42") is None


def write(run_dir, name, *lines):
    w = LedgerWriter(run_dir, name)
    for event, groups, fields in lines:
        w.write(event, groups, **fields)
    w.close()


def test_every_dispatched_group_has_one_outcome(tmp_path):
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000", "g00000001", "g00000002", "g00000003"], {}))
    write(tmp_path, "learner", ("trained", ["g00000000"], {"version": 1}))
    write(tmp_path, "buffer", ("dropped", ["g00000001"], {"reason": "stale"}), ("held", ["g00000002"], {}))
    out = reconcile_ledger(tmp_path, samples_per_group=2)
    assert out["dispatched"] == 8 and out["trained"] == 2 and out["dropped"] == {"stale": 2} and out["held"] == 2
    assert out["lost"] == 2 and out["lost_groups"] == ["g00000003"] and out["trained_twice"] == 0


def test_every_late_batch_the_learner_holds_is_an_outcome(tmp_path):
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000", "g00000001", "g00000002"], {}))
    write(
        tmp_path,
        "learner",
        ("trained", ["g00000000"], {"version": 1}),
        ("held", ["g00000001"], {}),
        ("held", ["g00000002"], {}),
    )
    out = reconcile_ledger(tmp_path, samples_per_group=1)
    assert out["held"] == 2 and out["lost"] == 0


def test_a_duplicate_drop_is_no_outcome_and_twice_trained_is_caught(tmp_path):
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000", "g00000001"], {}))
    write(
        tmp_path,
        "learner",
        ("trained", ["g00000000"], {"version": 1}),
        ("trained", ["g00000000"], {"version": 2}),
        ("dropped", ["g00000001"], {"reason": "duplicate"}),
    )
    out = reconcile_ledger(tmp_path)
    assert out["trained_twice_groups"] == ["g00000000"] and out["lost_groups"] == ["g00000001"]


def test_a_restore_rolls_back_what_the_checkpoint_does_not_hold(tmp_path):
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000", "g00000001", "g00000002"], {}))
    write(
        tmp_path,
        "learner",
        ("trained", ["g00000000"], {"version": 1}),
        ("trained", ["g00000001"], {"version": 2}),  # after the checkpoint: undone by the restore
    )
    write(tmp_path, "controller", ("restore", None, {"version": 1, "dispatched": 2}))
    # g2 was dispatched after the checkpoint: it is gone with the rest of that history.
    out = reconcile_ledger(tmp_path)
    assert out["restores"] == 1 and out["dispatched"] == 2 and out["lost_groups"] == ["g00000001"]
    write(tmp_path, "learner2", ("trained", ["g00000001"], {"version": 2}))  # trained again after the restore
    out = reconcile_ledger(tmp_path)
    assert out["lost"] == 0 and out["trained"] == 2 and out["trained_twice"] == 0


def test_a_torn_last_line_is_skipped(tmp_path):
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000"], {}))
    with open(tmp_path / "ledger" / "learner.jsonl", "a") as f:
        f.write(json.dumps({"t": 1.0, "event": "trained", "groups": ["g00000000"], "version": 1}) + "\n")
        f.write('{"t": 2.0, "event": "trai')  # the line a SIGKILL interrupted
    assert reconcile_ledger(tmp_path)["trained"] == 1


def test_a_copy_dropped_as_duplicate_does_not_hide_the_originals_drop(tmp_path):
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000"], {}), ("dispatched", ["g00000000"], {}))
    write(
        tmp_path,
        "buffer",
        ("dropped", ["g00000000"], {"reason": "duplicate"}),
        ("dropped", ["g00000000"], {"reason": "stale"}),
    )
    out = reconcile_ledger(tmp_path)
    assert out["lost"] == 0 and out["dropped"] == {"stale": 1}


def test_reuse_is_reported_beside_the_outcomes_and_rolled_back_by_a_restore(tmp_path):
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000", "g00000001"], {}))
    write(
        tmp_path,
        "learner",
        ("trained", ["g00000000", "g00000001"], {"version": 1}),
        ("retrained", ["g00000000"], {"version": 2}),  # the buffer's second hand-out: not twice trained
        ("retrained", ["g00000001"], {"version": 3}),  # after the checkpoint: undone by the restore
    )
    out = reconcile_ledger(tmp_path)
    assert out["trained"] == 2 and out["trained_twice"] == 0 and out["retrained"] == 2
    write(tmp_path, "controller", ("restore", None, {"version": 2, "dispatched": 2}))
    out = reconcile_ledger(tmp_path)
    assert out["retrained"] == 1 and out["retrained_untrained"] == 0 and out["lost"] == 0
    write(tmp_path, "learner2", ("retrained", ["g00000002"], {"version": 3}))  # a repeat of what never trained
    assert reconcile_ledger(tmp_path)["retrained_untrained"] == 1


def test_groups_in_flight_at_a_stop_are_not_lost_and_a_resume_gives_each_one_outcome(tmp_path):
    # g0..g2 dispatched before the checkpoint (version 1, horizon 3), g3 after; Ctrl-C at version 2
    write(tmp_path, "dispatcher", ("dispatched", ["g00000000", "g00000001", "g00000002", "g00000003"], {}))
    write(
        tmp_path,
        "learner",
        ("trained", ["g00000000"], {"version": 1}),
        ("trained", ["g00000001"], {"version": 2}),  # after the checkpoint
    )
    write(tmp_path, "buffer", ("dropped", ["g00000002"], {"reason": "stale"}))
    before = reconcile_ledger(tmp_path, samples_per_group=2)
    assert before["lost"] == 2 and before["in_flight_at_stop"] == 0  # no stop line: g3 is lost
    write(tmp_path, "controller", ("stop", None, {"reason": "interrupted (signal 2)", "version": 2}))
    out = reconcile_ledger(tmp_path, samples_per_group=2)
    assert out["in_flight_at_stop"] == 2 and out["lost"] == 0 and out["lost_groups"] == []
    assert out["trained"] == 4 and out["dropped"] == {"stale": 2}
    # the resume: back to version 1 (g1's training undone, g2's drop kept); g1 goes out again,
    # g3 is numbered anew from the horizon
    write(tmp_path, "controller2", ("restore", None, {"version": 1, "dispatched": 3}))
    out = reconcile_ledger(tmp_path)
    assert out["in_flight_at_stop"] == 0 and out["lost_groups"] == ["g00000001"]
    write(tmp_path, "dispatcher2", ("dispatched", ["g00000001", "g00000003", "g00000004"], {}))
    write(tmp_path, "learner2", ("trained", ["g00000001"], {"version": 2}), ("trained", ["g00000003"], {"version": 3}))
    out = reconcile_ledger(tmp_path)
    # the resumed run ended cleanly: g4, with no outcome, is lost; each other group has one outcome
    assert out["trained"] == 3 and out["trained_twice"] == 0 and out["dropped"] == {"stale": 1}
    assert out["in_flight_at_stop"] == 0 and out["lost_groups"] == ["g00000004"]
