"""The dispatcher's part of a checkpoint: the cursor, the counters, the rows not yet settled and
the staleness bound admission used (restored under ``buffer.max_staleness: auto``, so a resumed
run admits under the bound it stopped with until the learner's first word)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.dispatcher.admission import Admission
from asyncrl.dispatcher.cursor import MixedCursor, PromptCursor
from asyncrl.dispatcher.outstanding import BUFFERED, DISPATCHED, Entry, Outstanding


def save_dispatcher(
    path: Path, cursor: PromptCursor | MixedCursor, admission: Admission, outstanding: Outstanding, version: int
):
    state = {
        **cursor.state(),
        "dispatched": admission.dispatched,
        "dropped": admission.dropped,
        "short": admission.short(version),
        "version": version,
        "max_staleness": admission.max_staleness,
        "rows": outstanding.to_checkpoint(version),
    }
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def restore_dispatcher(
    ckpt: Path, cursor: PromptCursor | MixedCursor, admission: Admission, outstanding: Outstanding, auto: bool = False
) -> dict:
    """Load the dispatcher's part of checkpoint ``ckpt``; queue again what the other parts lack.
    ``auto``: the bound is the learner's (``buffer.max_staleness: auto``): restore the one saved."""
    from asyncrl.rundir.ledger import GroupIdSet

    state = json.loads((ckpt / "dispatcher.json").read_text())
    cursor.restore(state)
    admission.dispatched = int(state["dispatched"])
    admission.dropped = int(state["dropped"])
    admission.version = int(state["version"])
    admission.short_before = int(state.get("short", 0))  # steps after the checkpoint are trained anew
    if auto and state.get("max_staleness") is not None:
        admission.set_bound(int(state["max_staleness"]))
    held = set(json.loads((ckpt / "buffer" / "buffer_ids.json").read_text()))
    trained = GroupIdSet.from_bytes((ckpt / "learner" / "trained_ids.bin").read_bytes())
    again = [r for r in state["rows"] if r["group_id"] not in held and r["group_id"] not in trained]
    for row in state["rows"]:
        if row["group_id"] in held:
            outstanding.entries[row["group_id"]] = Entry(row, BUFFERED)
    for row in again:
        outstanding.entries[row["group_id"]] = Entry(row, DISPATCHED, at=float("inf"))
        outstanding.again.append(row)
        outstanding.unsent.add(row["group_id"])  # sent again as the staleness budget allows
    return {
        "version": admission.version,
        "dispatched": admission.dispatched,
        "again": len(again),
        "max_staleness": admission.max_staleness,
    }
