"""The group ledger: where every dispatched group ended, written as it happens, checkable by id.

Counters per process (``asyncrl.controller.accounting``) reconcile a run that stopped cleanly; they cannot
survive a process killed with SIGKILL. The ledger can: each process appends one JSON line per
event to ``RUN_DIR/ledger/NAME.jsonl`` (flushed, so a killed process loses at most the line it
was writing), naming the groups concerned:

- the dispatcher: ``dispatched`` (group ids, first time or again after a failure);
- the learner: ``trained`` (group ids and the version their step produced), and ``retrained``
  for the buffer's repeated hand-outs of a group trained before (``buffer.max_times_sampled != 1``);
- the buffer, generators and learner: ``dropped`` (group ids and the named reason);
- the buffer at its end: ``held`` (group ids never handed out); the learner: ``held`` for a batch
  that came after its last step;
- a generator at its end: ``returned`` (prompts that reached it after it stopped sampling);
- the controller: ``restore`` when the run went back to a checkpoint (``version``, ``dispatched``).

``reconcile_ledger`` replays the files in time order. A restore rolls back what the checkpoint
does not hold: steps after its version, and dispatches of groups it had not yet handed out. Each
group dispatched in the surviving history then has exactly one outcome — trained, dropped with a
reason, or held at the end — or it is ``lost``; a group trained twice in the surviving history is
``trained_twice``. Both must be 0. Reuse is reported beside them (``retrained``: every repeat), a
repeat of a group never trained as ``retrained_untrained``, which must be 0 too.

Group ids are ``g<sequence number>`` from the dispatcher; ``GroupIdSet`` keeps such ids as a
bitmap (an eighth of a byte per group ever dispatched, so days of training fit in megabytes) and
any other id in a plain set.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Protocol

_SEQ = re.compile(r"^g(\d{1,12})$")


def group_seq(group_id: str) -> int | None:
    """The dispatcher's sequence number in ``g00000042`` -> 42; None for any other id."""
    m = _SEQ.match(group_id)
    return int(m.group(1)) if m else None


def group_id_of(seq: int) -> str:
    return f"g{seq:08d}"


class GroupIdSet:
    """A set of group ids: dispatcher ids as bits, others as strings; saved as bytes."""

    def __init__(self) -> None:
        self._bits = bytearray()
        self._other: set[str] = set()
        self._count = 0

    def add(self, group_id: str) -> bool:
        """Add; True if it was not there."""
        seq = group_seq(group_id)
        if seq is None:
            if group_id in self._other:
                return False
            self._other.add(group_id)
        else:
            byte, bit = divmod(seq, 8)
            if byte >= len(self._bits):
                self._bits.extend(bytes(max(byte + 1 - len(self._bits), len(self._bits))))
            if self._bits[byte] >> bit & 1:
                return False
            self._bits[byte] |= 1 << bit
        self._count += 1
        return True

    def __contains__(self, group_id: str) -> bool:
        seq = group_seq(group_id)
        if seq is None:
            return group_id in self._other
        byte, bit = divmod(seq, 8)
        return byte < len(self._bits) and bool(self._bits[byte] >> bit & 1)

    def __len__(self) -> int:
        return self._count

    def to_bytes(self) -> bytes:
        import msgpack

        return msgpack.packb({"bits": bytes(self._bits), "other": sorted(self._other), "count": self._count})

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupIdSet:
        import msgpack

        body = msgpack.unpackb(data)
        out = cls()
        out._bits = bytearray(body["bits"])
        out._other = set(body["other"])
        out._count = int(body["count"])
        return out


class GroupLedger(Protocol):
    """Where a process writes its ledger lines: a ``LedgerWriter``, or one shared by several
    loops behind a lock (``asyncrl.generators.multiplex``)."""

    def write(self, event: str, groups: list[str] | None = None, **fields) -> None: ...


class LedgerWriter:
    """Appends this process's ledger lines to ``RUN_DIR/ledger/NAME.jsonl``; one line per call,
    flushed at once. Without a run directory (a process joined by address) it writes nothing."""

    def __init__(self, run_dir: Path | None, name: str):
        self._file = None
        if run_dir is not None:
            folder = Path(run_dir) / "ledger"
            folder.mkdir(parents=True, exist_ok=True)
            self._file = open(folder / f"{name}.jsonl", "a", buffering=1)

    def write(self, event: str, groups: list[str] | None = None, **fields) -> None:
        if self._file is None or (groups is not None and not groups):
            return
        line = {"t": time.time(), "event": event, **fields}
        if groups is not None:
            line["groups"] = list(groups)
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_ledger(run_dir: Path) -> list[dict]:
    """Every complete line of every ledger file, in time order (a torn last line is skipped)."""
    lines = []
    for path in sorted((Path(run_dir) / "ledger").glob("*.jsonl")):
        source = path.stem
        for raw in path.read_text().splitlines():
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue  # the line a killed process was writing
            line["source"] = source
            lines.append(line)
    lines.sort(key=lambda line: line["t"])
    return lines


def reconcile_ledger(run_dir: Path, samples_per_group: int = 1) -> dict:
    """Replay the ledger; return outcome counts (in samples) and the ids that break the rules."""
    dispatched: set[str] = set()
    trained: dict[str, list[int]] = {}  # group -> versions of the steps that trained it
    retrained: dict[str, list[int]] = {}  # group -> versions of the steps that trained it again (reuse)
    dropped: dict[str, str] = {}
    held: dict[str, set[str]] = {}  # source -> what it held at its end (its last report)
    returned: set[str] = set()
    restores = 0
    for line in read_ledger(run_dir):
        event, groups = line["event"], line.get("groups", [])
        if event == "dispatched":
            dispatched.update(groups)
        elif event in ("trained", "retrained"):
            into = trained if event == "trained" else retrained
            for g in groups:
                into.setdefault(g, []).append(int(line["version"]))
        elif event == "dropped":
            for g in groups:  # a copy dropped as a duplicate does not hide the fate of the original
                if dropped.get(g, "duplicate") == "duplicate":
                    dropped[g] = line["reason"]
        elif event == "held":
            held[line["source"]] = set(groups)
        elif event == "returned":
            returned.update(groups)
        elif event == "restore":
            restores += 1
            version, horizon = int(line["version"]), int(line["dispatched"])
            trained = {g: kept for g, vs in trained.items() if (kept := [v for v in vs if v <= version])}
            retrained = {g: kept for g, vs in retrained.items() if (kept := [v for v in vs if v <= version])}
            dispatched = {g for g in dispatched if (group_seq(g) or 0) < horizon or group_seq(g) is None}
            dropped = {g: r for g, r in dropped.items() if (group_seq(g) or 0) < horizon}
            held, returned = {}, set()
    held_at_end = set().union(*held.values()) if held else set()
    outcome: Counter[str] = Counter()
    dropped_by: Counter[str] = Counter()
    lost, twice = [], []
    for g in dispatched:
        if g in trained:
            outcome["trained"] += 1
            if len(trained[g]) > 1:
                twice.append(g)
        elif g in dropped and dropped[g] != "duplicate":
            outcome["dropped"] += 1
            dropped_by[dropped[g]] += 1
        elif g in held_at_end:
            outcome["held"] += 1
        elif g in returned:
            outcome["returned"] += 1
        else:
            lost.append(g)
    n = samples_per_group
    return {
        "dispatched": n * len(dispatched),
        "trained": n * outcome["trained"],
        "trained_twice": n * len(twice),
        "retrained": n * sum(len(vs) for vs in retrained.values()),
        "retrained_untrained": n * sum(1 for g in retrained if g not in trained),
        "dropped": {reason: n * k for reason, k in sorted(dropped_by.items())},
        "held": n * outcome["held"],
        "returned_unsampled": n * outcome["returned"],
        "lost": n * len(lost),
        "lost_groups": sorted(lost)[:20],
        "trained_twice_groups": sorted(twice)[:20],
        "restores": restores,
        "unit": f"samples ({n} per group)",
    }
