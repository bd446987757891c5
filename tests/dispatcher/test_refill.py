"""Refilling the slots of filtered groups (``buffer.zero_variance``): the admission rule of
``asyncrl.dispatcher.admission`` neither over-admits nor starves the learner.

A small discrete-time model of the pipeline drives the real ``Dispatcher.rows_for``,
``Outstanding`` and ``Admission``: generators ask every tick for prompts at the version they
serve, a group is scored ``latency`` ticks later and is either filtered (the buffer reports it
dropped) or stored, and the learner trains B stored groups, oldest first, whenever the buffer has
them. Groups arrive in the order they were dispatched: the rule's bound is for groups taken in
order (one overtaken by later ones can still turn stale, filter or not; the buffer's gate drops
it).
"""

import random
from collections import deque

from asyncrl.dispatcher.admission import Admission
from asyncrl.dispatcher.cursor import PromptCursor
from asyncrl.dispatcher.outstanding import Outstanding
from asyncrl.tasks.prompts import Prompt


def dispatcher_of(admission, outstanding, prompts=64):
    """A dispatcher without sockets: enough for ``rows_for``."""
    from asyncrl.dispatcher.process import Dispatcher

    d = Dispatcher.__new__(Dispatcher)
    cursor = PromptCursor([Prompt(f"p{i}", f"{i}+1=", str(i + 1), "t") for i in range(prompts)], seed=0, epochs=None)
    d.cursor, d.admission, d.outstanding = cursor, admission, outstanding
    return d


def simulate(filtered, steps=30, b=4, s=1, free_slot=True, ticks=2000, seed=0, latency=3):
    """Run until the learner has taken ``steps`` steps or ``ticks`` pass. ``filtered(rng)``: whether
    the next group scored is filtered. Returns (steps taken, staleness of each trained group,
    groups filtered, groups dispatched)."""
    rng = random.Random(seed)
    a, o = Admission(batch_groups=b, max_staleness=s), Outstanding(keep_trained=False)
    d = dispatcher_of(a, o)
    in_flight: deque = deque()  # (tick it is scored, group id, version that sampled it)
    stored: deque = deque()  # (group id, version), oldest first
    version, staleness, dropped = 0, [], 0
    for tick in range(ticks):
        if version >= steps:
            break
        # Two generators: one serves the learner's version, one lags a step behind it.
        for generator, serves in (("generator-0", version), ("generator-1", max(0, version - 1))):
            for row in d.rows_for(2, serves):
                o.dispatched(row, generator, float(tick))
                in_flight.append((tick + latency, row["group_id"], serves))
        for entry in sorted(e for e in in_flight if e[0] <= tick):
            in_flight.remove(entry)
            _, gid, v = entry
            if filtered(rng):
                dropped += 1
                retired = o.settle(dropped=[gid])  # the buffer's status names the group dropped
                if free_slot:
                    a.dropped += retired
            else:
                o.settle(inserted=[gid])
                stored.append((gid, v))
        if len(stored) >= b:  # the buffer hands out full batches only
            batch = [stored.popleft() for _ in range(b)]
            staleness += [version - v for _, v in batch]
            version += 1
            o.settle(trained=[(version, [g for g, _ in batch])])
            a.update(version)
            a.count_trained(version, b)
    return version, staleness, dropped, a.dispatched


def test_filtered_groups_are_refilled_and_every_trained_group_stays_within_the_bound():
    steps, staleness, dropped, dispatched = simulate(lambda rng: rng.random() < 0.4)
    assert steps == 30 and len(staleness) == 30 * 4  # the learner never lacked a full batch
    assert max(staleness) <= 1  # s: never over-admitted
    assert dropped > 30  # a real share was filtered, and as many refills went out
    assert dispatched >= 30 * 4 + dropped


def test_a_filtered_group_that_kept_its_slot_would_starve_the_learner():
    steps, _staleness, dropped, _dispatched = simulate(lambda rng: rng.random() < 0.4, free_slot=False)
    assert steps < 30  # the lead leaked away, one slot per filtered group, until nothing moved
    assert dropped <= (1 + 1 + steps) * 4  # everything ever admitted was scored


def test_the_docstring_example_frees_each_filtered_slot_once_and_refills_it():
    a, o = Admission(batch_groups=4, max_staleness=1), Outstanding()
    d = dispatcher_of(a, o)
    sent = d.rows_for(100, version=0)
    assert len(sent) == 8  # (1 + 0 + 1) * 4
    for row in sent:
        o.dispatched(row, "generator-0", 0.0)
    # The worked example of the module docstring: g2 and g5 answered all alike.
    a.dropped += o.settle(dropped=["g00000002", "g00000005"])
    assert a.capacity(0) == 2
    refills = d.rows_for(100, version=0)
    assert [r["group_id"] for r in refills] == ["g00000008", "g00000009"] and a.capacity(0) == 0
    # A second status naming g2 again (statuses repeat, copies arrive) frees nothing more.
    a.dropped += o.settle(dropped=["g00000002"])
    assert a.capacity(0) == 0
    a.update(1)
    a.count_trained(1, 4)
    assert a.capacity(1) == 4  # bound 12, 8 groups that may still train


def test_refills_keep_the_staleness_bound_at_every_filter_share():
    for share in (0.0, 0.2, 0.7):
        steps, staleness, _dropped, _dispatched = simulate(lambda rng, p=share: rng.random() < p, steps=15, seed=3)
        assert steps == 15 and max(staleness) <= 1, share


def test_a_resume_keeps_filtered_groups_settled_and_their_slots_free(tmp_path):
    import json

    from asyncrl.dispatcher.checkpoint import restore_dispatcher, save_dispatcher
    from asyncrl.rundir.ledger import GroupIdSet

    a, o = Admission(batch_groups=4, max_staleness=1), Outstanding()
    d = dispatcher_of(a, o)
    for row in d.rows_for(100, version=0):
        o.dispatched(row, "generator-0", 0.0)
    a.dropped += o.settle(dropped=["g00000002", "g00000005"], inserted=["g00000000", "g00000001"])
    for row in d.rows_for(100, version=0):  # the refills, g8 and g9
        o.dispatched(row, "generator-0", 0.0)
    ckpt = tmp_path / "v0"
    (ckpt / "buffer").mkdir(parents=True)
    (ckpt / "learner").mkdir()
    save_dispatcher(ckpt / "dispatcher.json", d.cursor, a, o, version=0)
    (ckpt / "buffer" / "buffer_ids.json").write_text(json.dumps(["g00000000", "g00000001"]))
    (ckpt / "learner" / "trained_ids.bin").write_bytes(GroupIdSet().to_bytes())

    a2, o2 = Admission(4, 1), Outstanding()
    restored = restore_dispatcher(ckpt, dispatcher_of(a2, o2).cursor, a2, o2)
    assert (a2.dispatched, a2.dropped) == (10, 2)
    # In flight at the checkpoint: g3 g4 g6 g7 g8 g9 go out again; the filtered g2 and g5 never do.
    again = sorted(r["group_id"] for r in o2.again)
    assert restored["again"] == 6 and again == [f"g{s:08d}" for s in (3, 4, 6, 7, 8, 9)]
    # They wait unsent, holding no slot, and go out again within the same budget: 8 - (10 - 2 - 6) = 6.
    assert a2.capacity(0, len(o2.unsent)) == 6
    sent = dispatcher_of(a2, o2).rows_for(100, version=0)
    assert [r["group_id"] for r in sent] == again and a2.capacity(0, len(o2.unsent)) == 0


def test_a_copy_stored_after_its_group_was_dropped_takes_its_slot_back():
    """A group sent again (its reward worker died) reaches the buffer twice: the first copy is
    filtered and frees the slot, the second, sampled anew, is stored and will be trained."""
    a, o = Admission(batch_groups=4, max_staleness=1), Outstanding()
    d = dispatcher_of(a, o)
    for row in d.rows_for(100, version=0):
        o.dispatched(row, "generator-0", 0.0)
    assert a.capacity(0) == 0
    a.dropped += o.settle(dropped=["g00000003"])
    assert a.capacity(0) == 1
    a.dropped += o.settle(inserted=["g00000003"])  # the copy, stored
    assert a.capacity(0) == 0 and o.entries["g00000003"].state == "buffered"
    a.dropped += o.settle(dropped=["g00000003"])  # and then stale in the buffer after all: freed again
    assert a.capacity(0) == 1
    # A third copy trained, whose storing the dispatcher did not hear of (a status lost), is charged too.
    a.dropped += o.settle(trained=[(1, ["g00000003"])])
    assert a.capacity(0) == 0
    a.dropped += o.settle(trained=[(1, ["g00000003"])])  # a repeated report charges nothing more
    assert a.capacity(0) == 0


def test_the_memory_of_dropped_groups_is_bounded(monkeypatch):
    from asyncrl.dispatcher import outstanding

    monkeypatch.setattr(outstanding, "RECENTLY_DROPPED", 3)
    o = Outstanding()
    for s in range(5):
        o.dispatched({"group_id": f"g{s:08d}"}, "generator-0", 0.0)
    assert o.settle(dropped=[f"g{s:08d}" for s in range(5)]) == 5
    assert list(o.recently_dropped) == ["g00000002", "g00000003", "g00000004"]
    assert o.settle(inserted=["g00000000"]) == 0  # forgotten: a copy that late is not charged
