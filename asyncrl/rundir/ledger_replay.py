"""Replay of the group ledger (``asyncrl.rundir.ledger``): one outcome per group, and compaction.

``reconcile_ledger`` replays every line in time order. A restore rolls back what the checkpoint
does not hold: steps after its version, and dispatches of groups it had not yet handed out. Each
group dispatched in the surviving history then has exactly one outcome — trained, dropped with a
reason, or held at the end — or it is ``lost``; a group trained twice in the surviving history is
``trained_twice``. Both must be 0. Reuse (``buffer.max_times_sampled != 1``) is reported beside
them: ``retrained`` counts every repeat, ``retrained_untrained`` a repeat of a group never
trained, which must be 0 too. Partial rollouts are reported in samples too: the samples of trained
groups left with no token trained (``masked`` lines) move from ``trained`` to ``dropped['stale']``,
beside ``stale_tokens_masked`` and ``resumed`` (answers resumed under a newer version).

A run the controller stopped before its end (Ctrl-C, SIGTERM, an abort) ends in a ``stop`` line,
written once every process has exited. The groups dispatched by then without an outcome were in
flight at the stop: ``in_flight_at_stop``, not ``lost``. They are not lost because a resume
restores the last checkpoint, whose dispatcher still holds each of them unsettled and sends it
again under the same id (the restore rolls back the dispatches it does not hold); the resume's
``restore`` line ends that state, so a group still without an outcome when the resumed run ends
is ``lost`` again.

Compaction keeps a month-long run's ledger to bits per group. At each committed checkpoint the
controller calls ``compact_ledger``: every line written before a cut time is replayed into
``LedgerReplay``, whose groups settled at or before ``fold_version`` (trained by a
step that checkpoint holds, dropped with a reason) are kept as bitmaps of dispatcher ids instead
of lines (~60 bytes per group and event); the state goes to ``ledger/compacted.bin`` (written
atomically, with its cut) and the closed segments wholly before the cut are removed. A replay
starts from that state and applies the lines from the cut on, so it reconciles exactly as the
lines would have — provided no restore goes back before ``fold_version`` (the controller folds
at the older of the last two checkpoints, and a replay refuses such a restore by name).

The cut is a minute before the compaction: a line is on disk within microseconds of its time
stamp, so every line before the cut is read, from closed and open segments alike (an open one
is only read: its writer goes on appending), and none is replayed out of order. A replay skips
the lines before the cut that an open segment (or a segment whose removal a crash prevented)
still holds.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack

from asyncrl.rundir.ledger import GroupIdSet, group_seq, iter_ledger, iter_lines, segments_by_source

COMPACTED = "compacted.bin"
CUT_MARGIN_S = 60.0
"""The cut stays this far behind now: a line is written within microseconds of its time stamp,
so every line before the cut is on disk when the compaction reads it."""


def _ids(groups) -> GroupIdSet:
    out = GroupIdSet()
    for g in groups:
        out.add(g)
    return out


class LedgerReplay:
    """What the replay knows at a point of the run's history.

    Groups still open to change are kept by id (``trained``: group -> versions of the steps that
    trained it, ...); ``fold`` turns those settled at or before a version into bitmaps (``*_settled``).
    """

    def __init__(self) -> None:
        self.dispatched = GroupIdSet()
        self.trained: dict[str, list[int]] = {}
        self.retrained: dict[str, list[int]] = {}
        self.dropped: dict[str, str] = {}
        self.held: dict[str, set[str]] = {}  # source -> what it held at its end (each late batch, for a learner)
        self.returned: set[str] = set()
        self.restores = 0
        self.trained_settled = GroupIdSet()
        """Trained once, by a step at or before ``folded_at``."""
        self.twice_settled = GroupIdSet()
        """Trained more than once, all at or before ``folded_at``."""
        self.dropped_settled: dict[str, GroupIdSet] = {}
        self.retrained_settled = 0
        self.masked: dict[int, list[int]] = {}
        """Step version -> [tokens masked as too stale, samples left with none trained] (``masked`` lines)."""
        self.masked_settled = [0, 0]
        """The same, summed over the steps at or before ``folded_at``."""
        self.resumed: dict[str, int] = {}
        """Group -> its answers aborted and resumed under a newer version (``resumed`` lines)."""
        self.resumed_settled = 0
        self.stopped: GroupIdSet | None = None
        """The groups dispatched when the run last stopped before its end (a ``stop`` line); None
        when it did not, or a restore has since resumed it."""
        self.folded_at: int | None = None

    # -- replay -----------------------------------------------------------------------------------

    def apply(self, line: dict) -> None:
        event, groups = line["event"], line.get("groups", [])
        if event == "dispatched":
            for g in groups:
                self.dispatched.add(g)
        elif event in ("trained", "retrained"):
            into = self.trained if event == "trained" else self.retrained
            for g in groups:
                if event == "trained" and g in self.trained_settled:  # trained again: open once more
                    self.trained_settled.discard(g)
                    self.trained[g] = [self.folded_at]
                elif event == "trained" and g in self.twice_settled:
                    self.twice_settled.discard(g)
                    self.trained[g] = [self.folded_at, self.folded_at]
                into.setdefault(g, []).append(int(line["version"]))
        elif event == "dropped":
            for g in groups:  # a copy dropped as a duplicate does not hide the fate of the original
                if self.dropped.get(g, "duplicate") == "duplicate" and not self._dropped_settled(g):
                    self.dropped[g] = line["reason"]
        elif event == "masked":
            counts = self.masked.setdefault(int(line["version"]), [0, 0])
            counts[0] += int(line.get("tokens", 0))
            counts[1] += len(line.get("dropped", ()))
        elif event == "resumed":  # one id per answer resumed
            for g in groups:
                self.resumed[g] = self.resumed.get(g, 0) + 1
        elif event == "held":  # a learner may hold several late batches, one line each
            self.held.setdefault(line["source"], set()).update(groups)
        elif event == "returned":
            self.returned.update(groups)
        elif event == "restore":
            self._restore(int(line["version"]), int(line["dispatched"]))
        elif event == "stop":  # every process had exited: what has no outcome yet was in flight
            self.stopped = GroupIdSet.from_bytes(self.dispatched.to_bytes())

    def _dropped_settled(self, g: str) -> bool:
        return any(g in ids for ids in self.dropped_settled.values())

    def _restore(self, version: int, horizon: int) -> None:
        if self.folded_at is not None and version < self.folded_at:
            raise ValueError(
                f"the ledger restores version {version}, before its compaction at version {self.folded_at}: "
                "steps folded there cannot be rolled back (compaction folds at the older of the last two checkpoints)"
            )
        self.restores += 1
        self.trained = {g: kept for g, vs in self.trained.items() if (kept := [v for v in vs if v <= version])}
        self.retrained = {g: kept for g, vs in self.retrained.items() if (kept := [v for v in vs if v <= version])}
        self.masked = {v: counts for v, counts in self.masked.items() if v <= version}
        self.resumed = {g: k for g, k in self.resumed.items() if (group_seq(g) or 0) < horizon}
        self.dispatched.discard_from(horizon)
        self.dropped = {g: r for g, r in self.dropped.items() if (group_seq(g) or 0) < horizon}
        for ids in self.dropped_settled.values():
            ids.discard_from(horizon)
        self.held, self.returned = {}, set()
        self.stopped = None  # the groups in flight at the stop go out again, and need an outcome

    # -- compaction -------------------------------------------------------------------------------

    def fold(self, version: int) -> None:
        """Keep the groups settled at or before ``version`` as bits: trained only by steps up to
        it, or dropped with a reason (a restore, never before ``version``, can only undo a drop
        of a group dispatched after the checkpoint: ``discard_from`` does that on bits too)."""
        if self.folded_at is not None and version < self.folded_at:
            return
        self.folded_at = version
        for g, vs in list(self.trained.items()):
            if max(vs) <= version and group_seq(g) is not None:
                (self.trained_settled if len(vs) == 1 else self.twice_settled).add(g)
                del self.trained[g]
        for g, vs in list(self.retrained.items()):  # repeats of a group settled as trained: a count
            if max(vs) <= version and (g in self.trained_settled or g in self.twice_settled):
                self.retrained_settled += len(vs)
                del self.retrained[g]
        for g, reason in list(self.dropped.items()):
            if group_seq(g) is not None:
                if reason != "duplicate":  # a duplicate is no outcome: nothing to keep
                    self.dropped_settled.setdefault(reason, GroupIdSet()).add(g)
                del self.dropped[g]
        for v in [v for v in self.masked if v <= version]:
            tokens, dropped = self.masked.pop(v)
            self.masked_settled = [self.masked_settled[0] + tokens, self.masked_settled[1] + dropped]
        # resumed answers of groups settled as trained (a restore keeps those); a drop carries no
        # version, so a later restore may still undo one: those groups' counts stay open
        for g in [g for g in self.resumed if g in self.trained_settled or g in self.twice_settled]:
            self.resumed_settled += self.resumed.pop(g)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "dispatched": self.dispatched.to_bytes(),
                "trained": self.trained,
                "retrained": self.retrained,
                "dropped": self.dropped,
                "held": {k: sorted(v) for k, v in self.held.items()},
                "returned": sorted(self.returned),
                "restores": self.restores,
                "trained_settled": self.trained_settled.to_bytes(),
                "twice_settled": self.twice_settled.to_bytes(),
                "dropped_settled": {k: v.to_bytes() for k, v in self.dropped_settled.items()},
                "retrained_settled": self.retrained_settled,
                "masked": self.masked,
                "masked_settled": self.masked_settled,
                "resumed": self.resumed,
                "resumed_settled": self.resumed_settled,
                "stopped": None if self.stopped is None else self.stopped.to_bytes(),
                "folded_at": self.folded_at,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> LedgerReplay:
        body = msgpack.unpackb(data, strict_map_key=False)
        out = cls()
        out.dispatched = GroupIdSet.from_bytes(body["dispatched"])
        out.trained, out.retrained, out.dropped = body["trained"], body["retrained"], body["dropped"]
        out.held = {k: set(v) for k, v in body["held"].items()}
        out.returned = set(body["returned"])
        out.restores = body["restores"]
        out.trained_settled = GroupIdSet.from_bytes(body["trained_settled"])
        out.twice_settled = GroupIdSet.from_bytes(body["twice_settled"])
        out.dropped_settled = {k: GroupIdSet.from_bytes(v) for k, v in body["dropped_settled"].items()}
        out.retrained_settled = body["retrained_settled"]
        # states compacted before partial rollouts were counted have none
        out.masked = {int(v): counts for v, counts in body.get("masked", {}).items()}
        out.masked_settled = body.get("masked_settled", [0, 0])
        out.resumed, out.resumed_settled = body.get("resumed", {}), body.get("resumed_settled", 0)
        stopped = body.get("stopped")  # states compacted before stop lines were written have none
        out.stopped = None if stopped is None else GroupIdSet.from_bytes(stopped)
        out.folded_at = body["folded_at"]
        return out

    # -- outcome ----------------------------------------------------------------------------------

    def result(self, samples_per_group: int = 1) -> dict:
        """Outcome counts (in samples) and the ids that break the rules; set algebra on the bits
        of dispatcher ids (Python integers), plain sets for any other id."""
        trained_any = _Ids.of(self.trained_settled) | _Ids.of(self.twice_settled) | _Ids.of(_ids(self.trained))
        twice = _Ids.of(self.twice_settled) | _Ids.of(_ids(g for g, vs in self.trained.items() if len(vs) > 1))
        recent: dict[str, list[str]] = {}
        for g, reason in self.dropped.items():
            if reason != "duplicate":
                recent.setdefault(reason, []).append(g)
        by_reason = {
            r: _Ids.of(self.dropped_settled.get(r, GroupIdSet())) | _Ids.of(_ids(recent.get(r, ())))
            for r in {*self.dropped_settled, *recent}
        }
        dropped_any = _Ids()
        for ids in by_reason.values():
            dropped_any = dropped_any | ids
        held = _Ids.of(_ids(set().union(*self.held.values()) if self.held else ()))
        returned = _Ids.of(_ids(self.returned))
        dispatched = _Ids.of(self.dispatched)
        outcome_trained = dispatched & trained_any
        rest = dispatched - trained_any
        dropped_by = {r: (rest & ids).count() for r, ids in sorted(by_reason.items())}
        rest = rest - dropped_any
        held_n = (rest & held).count()
        rest = rest - held
        returned_n = (rest & returned).count()
        rest = rest - returned
        stopped = _Ids.of(self.stopped) if self.stopped is not None else _Ids()
        in_flight = rest & stopped
        lost = rest - stopped
        twice_ids = dispatched & twice
        retrained_untrained = sum(
            1
            for g in self.retrained
            if g not in self.trained and g not in self.trained_settled and g not in self.twice_settled
        )
        n = samples_per_group
        masked_tokens = self.masked_settled[0] + sum(c[0] for c in self.masked.values())
        masked_dropped = self.masked_settled[1] + sum(c[1] for c in self.masked.values())
        dropped = {reason: n * k for reason, k in dropped_by.items() if k}
        if masked_dropped:  # samples of trained groups with no token trained: dropped, stale
            dropped["stale"] = dropped.get("stale", 0) + masked_dropped
        return {
            "dispatched": n * dispatched.count(),
            "trained": n * outcome_trained.count() - masked_dropped,
            "trained_twice": n * twice_ids.count(),
            "retrained": n * (self.retrained_settled + sum(len(vs) for vs in self.retrained.values())),
            "retrained_untrained": n * retrained_untrained,
            "dropped": dropped,
            "stale_tokens_masked": masked_tokens,
            "resumed": self.resumed_settled + sum(self.resumed.values()),
            "held": n * held_n,
            "returned_unsampled": n * returned_n,
            "in_flight_at_stop": n * in_flight.count(),
            "lost": n * lost.count(),
            "lost_groups": lost.first(20),
            "trained_twice_groups": twice_ids.first(20),
            "restores": self.restores,
            "unit": f"samples ({n} per group)",
        }


class _Ids:
    """An immutable id set for the outcome algebra: dispatcher ids as the bits of an int, others
    as a frozenset."""

    def __init__(self, bits: int = 0, others: frozenset = frozenset()):
        self.bits, self.others = bits, others

    @classmethod
    def of(cls, ids: GroupIdSet) -> _Ids:
        return cls(ids.as_int(), frozenset(ids.others))

    def __or__(self, o: _Ids) -> _Ids:
        return _Ids(self.bits | o.bits, self.others | o.others)

    def __and__(self, o: _Ids) -> _Ids:
        return _Ids(self.bits & o.bits, self.others & o.others)

    def __sub__(self, o: _Ids) -> _Ids:
        return _Ids(self.bits & ~o.bits, self.others - o.others)

    def count(self) -> int:
        return self.bits.bit_count() + len(self.others)

    def first(self, k: int) -> list[str]:
        """Up to ``k`` ids in sorted order (``g<seq>`` ids sort by number, as they are zero-padded)."""
        out, bits = [], self.bits
        while bits and len(out) < k:
            low = bits & -bits
            out.append(f"g{low.bit_length() - 1:08d}")
            bits ^= low
        return sorted(out + sorted(self.others))[:k]


def load_compacted(run_dir: Path) -> tuple[LedgerReplay, float]:
    """The compacted state and its cut time (a fresh state and -inf when never compacted)."""
    path = Path(run_dir) / "ledger" / COMPACTED
    if not path.exists():
        return LedgerReplay(), float("-inf")
    body = msgpack.unpackb(path.read_bytes())
    return LedgerReplay.from_bytes(body["state"]), float(body["cut"])


def reconcile_ledger(run_dir: Path, samples_per_group: int = 1) -> dict:
    """Replay the ledger (its compacted state, then every line from the cut on, streamed:
    ``iter_ledger``); return outcome counts (in samples) and the ids that break the rules."""
    state, cut = load_compacted(run_dir)
    for line in iter_ledger(run_dir, since=cut):
        state.apply(line)
    return state.result(samples_per_group)


def compact_ledger(run_dir: Path, fold_version: int, now: float | None = None) -> dict:
    """Fold every line before the cut (a minute before ``now``) into ``ledger/compacted.bin``,
    groups settled at or before ``fold_version`` as bits, and remove the closed segments wholly
    before the cut. Returns ``{cut, removed, bytes}``; nothing is done without a closed segment
    (the open ones are bounded by the writers' ``segment_bytes``).

    Memory: the lines are streamed, merged by time stamp one line per source at a time
    (``iter_ledger``), never read whole: what a compaction holds is the replay's state (the
    groups not yet settled, by id, and the bitmaps), not the segments it reads, whatever their
    size (``checkpoint.ledger_segment_mb``)."""
    folder = Path(run_dir) / "ledger"
    by_source = segments_by_source(run_dir)
    if not any(index is not None for segments in by_source.values() for index, _p in segments):
        return {"cut": None, "removed": 0, "bytes": ledger_bytes(run_dir)}
    state, old_cut = load_compacted(run_dir)
    cut = max((time.time() if now is None else now) - CUT_MARGIN_S, old_cut)
    late: set[Path] = set()  # segments holding a line at or past the cut: kept

    def before_cut(source: str, segments: list) -> Iterator[dict]:
        for _index, path in segments:
            for line in iter_lines(path, source):
                if line["t"] >= cut:
                    late.add(path)  # read on: a clock stepped back may stamp a later line older
                elif line["t"] >= old_cut:
                    yield line

    streams = [before_cut(source, segments) for source, segments in sorted(by_source.items())]
    for line in heapq.merge(*streams, key=lambda ln: ln["t"]):
        state.apply(line)
    state.fold(fold_version)
    tmp = folder / f".{COMPACTED}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb({"cut": cut, "state": state.to_bytes()}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / COMPACTED)  # a replay sees the old state or the new one, whole
    removed = 0
    for segments in by_source.values():
        for index, path in segments:  # their lines are all before the cut: a replay skips them anyway
            if index is not None and path not in late:
                path.unlink()
                removed += 1
    return {"cut": cut, "removed": removed, "bytes": ledger_bytes(run_dir)}


def ledger_bytes(run_dir: Path) -> int:
    """Bytes the run's ledger takes on disk (segments and the compacted state)."""
    folder = Path(run_dir) / "ledger"
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.exists() else 0
