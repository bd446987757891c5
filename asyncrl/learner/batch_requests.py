"""The learner's side of its conversation with the buffer: ask for a batch, report what was trained.

Each request (``want_batch``) asks for ``learner.batch_groups`` groups and states the learner's
version (the buffer drops groups too stale for it) and, under ``buffer.max_staleness: auto``, the
staleness bound the learner set. It carries back what the previous step did:
the groups just trained (``trained``, which the buffer passes on to the dispatcher) and, when
the buffer samples by priority, their new priorities (``priority_updates``: each group's mean
|advantage|); both are sent once, with the first request that gets a reply.

The reply carries each group's importance weight (``is_weights``), which scales that group's
loss (all 1 unless the buffer samples by priority with β > 0), and whether the buffer handed that
very copy out before (``repeat``). A group trained before is trained again only as such a repeat,
which the buffer bounds by ``buffer.max_times_sampled``: any other copy (dispatched again after a
failure: a buffer restarted empty, a lost report) is taken out of the batch, counted as dropped
(``duplicate``) and written to the ledger, and so are the buffer's later hand-outs of that copy.
So no group is trained more often than reuse allows, across buffer restarts and, as
``trained_ids`` is part of the learner's checkpoint, across resumes. (The copies taken out are
remembered while the staleness bound lets them come back, not in the checkpoint: after a resume
the buffer's snapshot holds what it held then.) ``trained`` says how many samples a step trained
for the first time: those of groups new to ``trained_ids``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncrl.learner.batch import stale_samples
from asyncrl.learner.totals import Counters
from asyncrl.rundir.ledger import GroupIdSet, GroupLedger
from asyncrl.wire.messages import Batch as BatchReply
from asyncrl.wire.messages import PriorityUpdates, TrainedGroups, WantBatch
from asyncrl.wire.schema import Group
from asyncrl.wire.sockets import RequestClient

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One batch from the buffer, ready to train."""

    groups: list[Group]
    """The groups to train, in the buffer's order, copies of groups trained before taken out."""
    is_weights: list[float] | None
    """One importance weight per group of ``groups``; None: all 1."""
    group_keys: list | None
    """The buffer's keys of the groups it handed out, for ``priority_updates``; None unless it
    samples by priority."""
    wait_s: float
    """Seconds the request that brought it waited for the reply."""
    repeat: list[bool] = field(default_factory=list)
    """Per group of ``groups``, whether the buffer had handed out this copy before (reuse)."""


class BatchRequester:
    """Asks the buffer for batches over ``client`` and tells it which groups were trained.

    ``counters.dropped`` and the ledger record the copies taken out; ``trained_ids`` is every group
    trained in the run's history (restored from a checkpoint on a resume).
    """

    def __init__(
        self, client: RequestClient, cfg: RunConfig, ledger: GroupLedger, counters: Counters, trained_ids: GroupIdSet
    ):
        self.client = client
        self.cfg = cfg
        self.ledger = ledger
        self.counters = counters
        self.trained_ids = trained_ids
        self._refused: dict[int, set[str]] = {}
        """policy_version -> ids of copies taken out, while the buffer may hand them out again."""
        self._priority_updates: PriorityUpdates | None = None
        self._just_trained: TrainedGroups | None = (
            None  # the last step's groups, reported to the dispatcher via the buffer
        )
        self.max_staleness: int | None = None
        """The bound the learner set (``buffer.max_staleness: auto``), sent with every request."""

    def receive(self, version: int) -> Batch | None:
        """Ask once for a batch for policy ``version``: waits at most ``learner.batch_timeout_s``
        for the buffer's reply. None when it timed out, was empty, or held only copies of groups
        trained before (then ask again)."""
        learner = self.cfg.learner
        wait_start = time.monotonic()
        request = WantBatch(
            num_groups=learner.batch_groups,
            policy_version=version,
            timeout_s=learner.batch_timeout_s,
            priority_updates=self._priority_updates,
            trained=self._just_trained,
            max_staleness=self.max_staleness,
        )
        reply = self.client.request(request, timeout=learner.batch_timeout_s)
        if reply is not None:
            self._priority_updates = self._just_trained = None  # delivered with that request
        sampled = reply[1] if reply is not None and isinstance(reply[1], BatchReply) else BatchReply()
        if not sampled.groups:
            log.info("learner: waiting for a batch of %d groups at version %d", learner.batch_groups, version)
            return None
        repeat = sampled.repeat or [False] * len(sampled.groups)
        keep = [self._may_train(g, again, version) for g, again in zip(sampled.groups, repeat)]
        groups = [g for g, k in zip(sampled.groups, keep) if k]
        if len(groups) < len(sampled.groups):
            copies = [g for g, k in zip(sampled.groups, keep) if not k]
            self.counters.dropped["duplicate"] += sum(len(g.samples) for g in copies)
            self.ledger.write("dropped", [g.group_id for g in copies], reason="duplicate")
            if not groups:
                return None
        is_weights = [w for w, k in zip(sampled.is_weights, keep) if k] or None  # none sent: all 1
        group_keys = [key for key, k in zip(sampled.group_keys, keep) if k] or None
        again = [a for a, k in zip(repeat, keep) if k]
        return Batch(groups, is_weights, group_keys, time.monotonic() - wait_start, again)

    def _may_train(self, group: Group, repeat: bool, version: int) -> bool:
        """Whether ``group`` may be trained: never trained before, or a repeated hand-out of the copy
        that was (the buffer's reuse), not of a copy taken out before."""
        refused = self._refused.get(group.policy_version)
        if group.group_id not in self.trained_ids:
            return True
        if repeat and (refused is None or group.group_id not in refused):
            return True
        self._refused.setdefault(group.policy_version, set()).add(group.group_id)
        stale = self.cfg.buffer.staleness_ceiling  # under auto, the highest the bound can be
        if stale is not None:  # past the staleness bound the buffer drops a copy: it cannot come back
            for v in [v for v in self._refused if version - v > stale + 1]:
                del self._refused[v]
        return False

    def trained(self, batch: Batch, version: int, priorities: list[float] | None = None) -> tuple[int, int]:
        """Record that ``batch`` was trained, giving policy ``version``: in ``trained_ids`` and the
        ledger (``trained`` the first time, ``retrained`` for the buffer's repeats), and for the
        next request (with the groups' new ``priorities``, if any).

        Stale segments masked out of the loss (``Sample.trained_from``) go to the ledger as
        ``masked`` (the groups, their masked tokens, the samples left with none trained); those
        samples count as dropped, ``stale``, at their group's first training. Returns (samples
        trained for the first time, samples dropped so)."""
        first, again, first_samples, dropped = [], [], 0, []
        for g in batch.groups:
            if self.trained_ids.add(g.group_id):
                first.append(g.group_id)
                stale = stale_samples(g)
                first_samples += len(g.samples) - len(stale)
                dropped.extend(stale)
            else:
                again.append(g.group_id)
        self._just_trained = TrainedGroups(version=version, group_ids=[g.group_id for g in batch.groups])
        self.ledger.write("trained", first, version=version)
        self.ledger.write("retrained", again, version=version)
        masked = [g for g in batch.groups if any(s.trained_from for s in g.samples)]
        if masked:
            tokens = sum(s.trained_from for g in masked for s in g.samples)
            self.ledger.write("masked", [g.group_id for g in masked], version=version, tokens=tokens, dropped=dropped)
        self.counters.dropped["stale"] += len(dropped)
        if priorities is not None and batch.group_keys is not None:
            self._priority_updates = PriorityUpdates(group_keys=batch.group_keys, priorities=priorities)
        return first_samples, len(dropped)

    def take_late(self) -> int:
        """After the last step: take a batch that still arrives (a reply to a request that timed
        out), waiting at most 0.1 s, and hold it, untrained, rather than lose it in the socket;
        written to the ledger as ``held``. Returns its samples (0 when none came)."""
        late = self.client.receive(timeout=0.1)
        if late is None or not isinstance(late[1], BatchReply):
            return 0
        self.ledger.write("held", [g.group_id for g in late[1].groups])
        return sum(len(g.samples) for g in late[1].groups)

    def close(self) -> None:
        self.client.close()
