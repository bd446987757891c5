"""At-least-once dispatch: every group handed out and not yet settled for good, and what to hand out again.

Until a group is settled for good (dropped with a reason, or trained by a step a committed
checkpoint holds) the dispatcher keeps its prompt row, and learns what became of it from the
buffer's status (inserted, dropped, trained). When the controller reports a death, or a group's
lease runs out unseen, the rows that may have been lost are dispatched again, first, under the
same group id. A row queued again gives up its slot in the staleness budget until it is sent
again (``unsent``; ``asyncrl.dispatcher.admission``), so it goes out only as the budget allows,
like a new prompt: after a restore the rows in flight at the checkpoint and those trained after
it all go out again, and sent at once they let more groups run than can be trained within the
bound, so that the ones the learner took last were dropped as stale.

A dead reward worker or buffer took with it only what it held; the groups still being sampled
upstream reach the restarted process in a few seconds. Those (dispatched, not yet in the buffer)
are not queued at once but given a short lease (``grace_s``): one that turns up in the buffer
meanwhile is not sampled a second time, and one that does not goes out again when that lease
runs out. A copy sent at once ran beside its original outside the staleness budget, and
whichever of the two came second was dropped (as a duplicate, or as stale in the buffer).

A copy can also outlive its group's drop: the first copy to reach the buffer is dropped (stale,
or filtered because its answers all scored alike: ``buffer.zero_variance``) and frees its slot,
then the other, sampled anew, is stored and will be trained. The dropped rows are remembered for
a while (``RECENTLY_DROPPED``) so that such a copy takes its slot back when the buffer reports it
stored; without that, each such copy let one more group run than the staleness budget allows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

DISPATCHED, BUFFERED, TRAINED = "dispatched", "buffered", "trained"
RECENTLY_DROPPED = 4096
"""Dropped groups whose rows are remembered, newest kept, in case a copy of one is stored later."""


@dataclass
class Entry:
    row: dict
    state: str = DISPATCHED
    generator: str = ""
    at: float = 0.0
    version: int = -1
    """For TRAINED: the learner version of the step that trained it."""


@dataclass
class Outstanding:
    """Every group dispatched and not yet settled for good, and the queue of groups to hand out again.

    A group is settled for good when it is dropped with a reason, or trained by a step that a
    committed checkpoint holds (``forget_trained``). Until then its prompt row is kept, so that
    whatever is lost downstream — a generator or reward worker killed with its groups, a buffer
    restarted empty, a learner restored to an older version — is dispatched again under the same
    group id. What the buffer and learner report arrives on a PUB socket that may drop messages
    under load; a missed report only makes a group go out again, and ids keep the copy from being
    trained twice.
    """

    lease_s: float = 600.0
    grace_s: float = 0.0
    """Seconds the groups not yet in the buffer are given to turn up there after a reward worker
    or the buffer died, before they are dispatched again (0: at once)."""
    entries: dict[str, Entry] = field(default_factory=dict)
    again: deque = field(default_factory=deque)
    """Rows to dispatch again, before any new prompt."""
    requeued: int = 0
    passed_over: int = 0
    """Rows queued again but not sent: their group was settled meanwhile (``take_again``)."""
    keep_trained: bool = True
    """Keep trained groups until a checkpoint holds them (False when the run takes no checkpoints:
    nothing could bring them back, and memory stays flat)."""
    handled: deque = field(default_factory=lambda: deque(maxlen=256))
    """Ids of requeue commands already acted on."""
    unsent: set[str] = field(default_factory=set)
    """Groups queued again and neither sent since nor seen downstream: they hold no slot of the
    staleness budget (the admission counts dispatched - dropped - len(unsent))."""
    recently_dropped: OrderedDict = field(default_factory=OrderedDict)
    """Group id -> row of the last ``RECENTLY_DROPPED`` groups dropped, oldest first."""

    def dispatched(self, row: dict, generator: str, now: float) -> None:
        e = self.entries.get(row["group_id"])
        if e is None:
            self.entries[row["group_id"]] = Entry(row, DISPATCHED, generator, now)
        else:
            e.state, e.generator, e.at = DISPATCHED, generator, now

    def settle(
        self, inserted: Iterable[str] = (), dropped: Iterable[str] = (), trained: Iterable[tuple[int, list[str]]] = ()
    ) -> int:
        """Apply what became of groups (a buffer status report's, or a generator's drops): ``inserted``
        and ``dropped`` ids, ``trained`` [version, ids] pairs.
        Returns how many outstanding groups it retires untrained, net: each frees its admission
        slot once, however many copies of it are dropped (a copy of a trained group frees
        nothing), and a group dropped before and now stored (a copy) takes its slot back (-1)."""
        retired = 0
        for gid in inserted:
            e = self.entries.get(gid)
            if e is None and gid in self.recently_dropped:  # a copy outlived the drop: it may be trained
                self.entries[gid] = Entry(self.recently_dropped.pop(gid), BUFFERED)
                retired -= 1
            elif e is not None and e.state == DISPATCHED:
                e.state = BUFFERED
                self.unsent.discard(gid)  # its original turned up: it holds its slot again
        for gid in dropped:
            e = self.entries.get(gid)
            if e is not None and e.state != TRAINED:
                del self.entries[gid]
                self.unsent.discard(gid)
                self.recently_dropped[gid] = e.row
                if len(self.recently_dropped) > RECENTLY_DROPPED:
                    self.recently_dropped.popitem(last=False)
                retired += 1
        for version, gids in trained:
            for gid in gids:
                self.unsent.discard(gid)
                if gid not in self.entries and self.recently_dropped.pop(gid, None) is not None:
                    retired -= 1  # a copy trained whose storing went unheard: it took a slot after all
                e = self.entries.get(gid)
                if e is not None and not self.keep_trained:
                    del self.entries[gid]
                elif e is not None:
                    e.state, e.version = TRAINED, int(version)
        return retired

    def forget_trained(self, version: int) -> None:
        """A checkpoint at ``version`` is committed: its trained groups can never come back."""
        for gid in [g for g, e in self.entries.items() if e.state == TRAINED and e.version <= version]:
            del self.entries[gid]

    def requeue(self, scope: str, generator: str | None = None, now: float | None = None) -> int:
        """Queue again the groups a failure may have lost; returns how many are queued now.

        ``generator``: those dispatched to that generator and not yet in the buffer;
        ``in_flight``: every group not yet in the buffer (a reward worker died);
        ``buffered``: every group not yet trained (the buffer died);
        ``expired``: groups not in the buffer after ``lease_s`` (``now`` required).
        For ``in_flight`` and ``buffered`` with ``grace_s`` > 0 (``now`` required), the groups
        not yet in the buffer are not queued but leased for ``grace_s`` more seconds
        (``shorten_leases``): most are still upstream of the dead process.
        """
        states = {"generator": (DISPATCHED,), "in_flight": (DISPATCHED,), "buffered": (DISPATCHED, BUFFERED)}
        if scope == "expired":
            picked = [e for e in self.entries.values() if e.state == DISPATCHED and now - e.at > self.lease_s]
        elif scope in states:
            picked = [e for e in self.entries.values() if e.state in states[scope]]
            if scope == "generator":
                picked = [e for e in picked if e.generator == generator]
            elif self.grace_s > 0:
                self.shorten_leases([e for e in picked if e.state == DISPATCHED], now)
                picked = [e for e in picked if e.state != DISPATCHED]
        else:
            raise ValueError(f"requeue scope {scope!r} is not one of generator, in_flight, buffered, expired")
        return self._queue(picked)

    def shorten_leases(self, entries: list[Entry], now: float | None) -> None:
        """Let ``entries`` expire ``grace_s`` seconds from ``now`` unless the buffer sees them first
        (a group already queued, or already due sooner, is left as it is)."""
        if now is None:
            raise ValueError(f"a requeue with grace_s ({self.grace_s}) > 0 needs the time now")
        at = now + self.grace_s - self.lease_s
        for e in entries:
            if e.at != float("inf"):
                e.at = min(e.at, at)

    def _queue(self, picked: list[Entry]) -> int:
        queued = {r["group_id"] for r in self.again}
        picked = [e for e in picked if e.row["group_id"] not in queued]
        for e in picked:
            e.state, e.at = DISPATCHED, float("inf")  # not expired again while it waits in the queue
            self.again.append(e.row)
            self.unsent.add(e.row["group_id"])
        self.requeued += len(picked)
        return len(picked)

    def take_again(self, k: int) -> list[dict]:
        """Up to ``k`` rows to dispatch again (each takes a slot of the budget again). Rows settled since they were queued are passed
        over: the original turned up in the buffer after all (a reward worker or the buffer died
        while it was on its way), was trained, or was dropped. A copy of those would only be
        sampled to be thrown away."""
        rows: list[dict] = []
        while self.again and len(rows) < k:
            row = self.again.popleft()
            e = self.entries.get(row["group_id"])
            if e is not None and e.state == DISPATCHED:
                rows.append(row)
                self.unsent.discard(row["group_id"])
            else:
                self.unsent.discard(row["group_id"])
                self.passed_over += 1
        return rows

    def to_checkpoint(self, version: int) -> list[dict]:
        """Rows a resume from a checkpoint of ``version`` must dispatch again (less what it holds)."""
        return [e.row for e in self.entries.values() if not (e.state == TRAINED and e.version <= version)]
