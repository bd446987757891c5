"""The group ledger: where every dispatched group ended, written as it happens, checkable by id.

Counters per process (``asyncrl.controller.accounting``) reconcile a run that stopped cleanly; they cannot
survive a process killed with SIGKILL. The ledger can: each process appends one JSON line per
event to ``RUN_DIR/ledger/NAME.jsonl`` (flushed, so a killed process loses at most the line it
was writing), naming the groups concerned:

- the dispatcher: ``dispatched`` (group ids, first time or again after a failure);
- the learner: ``trained`` (group ids and the version their step produced), and ``retrained``
  for the buffer's repeated hand-outs of a group trained before (``buffer.max_times_sampled != 1``);
- the buffer, generators and learner: ``dropped`` (group ids and the named reason);
- the learner: ``masked`` (groups trained with tokens past the staleness bound kept as context
  only: the step's ``version``, those ``tokens``, and the uids ``dropped`` of samples left with
  none trained, which count as dropped, ``stale``; ``generator.partial_rollouts``);
- a generator: ``resumed`` (one group id per answer aborted at a weight update and resumed
  under the new version; ``generator.partial_rollouts: resume``);
- the buffer at its end: ``held`` (group ids never handed out); the learner: ``held`` for a batch
  that came after its last step;
- a generator at its end: ``returned`` (prompts that reached it after it stopped sampling);
- the controller: ``restore`` when the run went back to a checkpoint (``version``, ``dispatched``),
  and ``stop`` when it stopped the run before its end (Ctrl-C, SIGTERM, an abort: ``reason``,
  ``version``), once every process had exited.

``asyncrl.rundir.ledger_replay`` replays the files in time order and checks that each group
dispatched has exactly one outcome, and compacts what a committed checkpoint settled.

Files are segments: past ``segment_bytes`` a writer closes ``NAME.jsonl`` as ``NAME.<k>.jsonl``
(k = 1, 2, ...) and begins a new ``NAME.jsonl``; the compaction only reads an open segment and
only removes closed ones, so a writer never loses a line to it.

Group ids are ``g<sequence number>`` from the dispatcher; ``GroupIdSet`` keeps such ids as a
bitmap (an eighth of a byte per group ever dispatched, so days of training fit in megabytes) and
any other id in a plain set.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import time
from collections.abc import Iterator
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

    def discard(self, group_id: str) -> None:
        seq = group_seq(group_id)
        if seq is None:
            if group_id in self._other:
                self._other.discard(group_id)
                self._count -= 1
        elif group_id in self:
            self._bits[seq // 8] &= ~(1 << seq % 8) & 0xFF
            self._count -= 1

    def discard_from(self, seq: int) -> None:
        """Remove every dispatcher id numbered ``seq`` or above (other ids stay)."""
        byte, bit = divmod(seq, 8)
        if byte >= len(self._bits):
            return
        self._bits[byte] &= (1 << bit) - 1
        del self._bits[byte + 1 :]
        self._count = self.as_int().bit_count() + len(self._other)

    def as_int(self) -> int:
        """The dispatcher ids as the bits of one integer (bit ``seq`` set for ``g<seq>``), for
        set algebra over millions of ids at C speed."""
        return int.from_bytes(self._bits, "little")

    @property
    def others(self) -> set[str]:
        """The ids that are not the dispatcher's."""
        return self._other

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


SEGMENT = re.compile(r"^(?P<source>.+?)(?:\.(?P<index>\d+))?\.jsonl$")
"""A ledger file's name: ``NAME.jsonl`` (the open segment) or ``NAME.<k>.jsonl`` (closed)."""


class LedgerWriter:
    """Appends this process's ledger lines to ``RUN_DIR/ledger/NAME.jsonl``; one line per call,
    flushed at once. Past ``segment_bytes`` the file is closed as ``NAME.<k>.jsonl`` and a new
    one begun (``None``: never). Without a run directory (a process joined by address) it writes
    nothing."""

    def __init__(self, run_dir: Path | None, name: str, segment_bytes: int | None = None):
        if segment_bytes is not None and segment_bytes < 1:
            raise ValueError(f"segment_bytes ({segment_bytes}) must be >= 1 or None")
        self._file = None
        self.segment_bytes = segment_bytes
        if run_dir is not None:
            self._folder = Path(run_dir) / "ledger"
            self._folder.mkdir(parents=True, exist_ok=True)
            self._path = self._folder / f"{name}.jsonl"
            self._name = name
            self._file = open(self._path, "a", buffering=1)

    def write(self, event: str, groups: list[str] | None = None, **fields) -> None:
        if self._file is None or (groups is not None and not groups):
            return
        line = {"t": time.time(), "event": event, **fields}
        if groups is not None:
            line["groups"] = list(groups)
        self._file.write(json.dumps(line) + "\n")
        if self.segment_bytes is not None and self._file.tell() >= self.segment_bytes:
            self._rotate()

    def _rotate(self) -> None:
        """Close this segment under the next free index and begin a new one."""
        self._file.close()
        taken = [
            int(m["index"])
            for p in self._folder.glob(f"{glob_escape(self._name)}.*.jsonl")
            if (m := SEGMENT.match(p.name)) and m["source"] == self._name and m["index"]
        ]
        os.rename(self._path, self._folder / f"{self._name}.{max(taken, default=0) + 1}.jsonl")
        self._file = open(self._path, "a", buffering=1)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def ledger_segments(run_dir: Path) -> list[tuple[str, int | None, Path]]:
    """Every ledger file as (source, index, path): index None for a writer's open segment."""
    out = []
    for path in sorted((Path(run_dir) / "ledger").glob("*.jsonl")):
        m = SEGMENT.match(path.name)
        if m is not None:
            out.append((m["source"], int(m["index"]) if m["index"] else None, path))
    return out


def iter_lines(path: Path, source: str) -> Iterator[dict]:
    """Every complete line of one ledger file, one at a time (a torn last line is skipped),
    tagged with ``source``: a segment of any size is read in constant memory."""
    with open(path, "rb") as f:
        for raw in f:
            try:
                line = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # the line a killed process was writing
            line["source"] = source
            yield line


def read_lines(path: Path, source: str) -> list[dict]:
    """Every complete line of one ledger file (a torn last line is skipped), tagged with ``source``."""
    return list(iter_lines(path, source))


def segments_by_source(run_dir: Path) -> dict[str, list[tuple[int | None, Path]]]:
    """Each source's segments in the order they were written: closed ones by index, then the
    open one (``ledger_segments`` lists them by name, where ``.10`` sorts before ``.2``)."""
    out: dict[str, list[tuple[int | None, Path]]] = {}
    for source, index, path in ledger_segments(run_dir):
        out.setdefault(source, []).append((index, path))
    for segments in out.values():
        segments.sort(key=lambda item: float("inf") if item[0] is None else item[0])
    return out


def iter_ledger(run_dir: Path, since: float = float("-inf")) -> Iterator[dict]:
    """Every complete line stamped ``since`` or later, of every ledger file, in time order,
    holding one line per source at a time: each source's segments are read in the order they
    were written and merged by time stamp (a writer appends its lines in time order)."""
    streams = [
        (line for _index, path in segments for line in iter_lines(path, source) if line["t"] >= since)
        for source, segments in sorted(segments_by_source(run_dir).items())
    ]
    return heapq.merge(*streams, key=lambda line: line["t"])


def read_ledger(run_dir: Path) -> list[dict]:
    """Every complete line of every ledger file (open and closed segments), in time order."""
    return list(iter_ledger(run_dir))
