"""The buffer's loop around a ``ReplayBuffer``: one thread, blocked in ``zmq.Poller`` until a socket
has work or a held request's deadline comes; never a busy loop.

- Inserts. While the rate limiter forbids an insert, the input socket is not polled (see
  ``GroupIntake``). Past capacity the oldest groups are evicted (FIFO), never the newcomer.
- Batches. A learner's ``want_batch`` feeds the learner version to the staleness gate, applies its
  priority updates (for the groups of its previous batch), and is held until ``num_groups``
  groups may be sampled, then answered with the groups (their stale segments masked, under
  ``generator.partial_rollouts``: ``asyncrl.buffer.stale_segments``), their buffer keys, P(i) and importance
  weights; or answered empty just before its deadline, so the learner logs what it waits for and
  asks again. Several learners may hold requests at once; they are served in arrival order.
- Status. After every change, and every second for late subscribers, ``buffer_status`` carries
  the learner version and the groups settled, for the dispatcher's admission rule.
- The bound. Under ``buffer.max_staleness: auto`` each request carries the staleness bound the
  learner set; the gate applies it before the request's version, and ``buffer_status`` passes it
  on with that version, so the dispatcher admits under the bound the gate drops by.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import zmq

from asyncrl.buffer.channels import BatchRequests, GroupIntake, StatusPublisher
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.buffer.stale_segments import mark_trained_from
from asyncrl.observability import metrics as m
from asyncrl.wire.messages import Batch, BufferStatus, WantBatch
from asyncrl.wire.sockets import Publisher, ReplyServer, StreamReceiver

log = logging.getLogger(__name__)

INSERTS_PER_WAKE = 64  # inserts taken per wake-up before requests are looked at again
BLOCKED_WARN_S = 30.0
STATUS_EVERY_S = 1.0


class BufferService:
    """The loop around a ``ReplayBuffer``; ``step`` is one wake-up (tests drive it in a thread)."""

    def __init__(self, buf: ReplayBuffer, inbox: StreamReceiver, requests: ReplyServer, status: Publisher):
        self.buf = buf
        self.inbox, self.requests, self.status = inbox, requests, status
        self.intake, self.batches, self.news = GroupIntake(inbox), BatchRequests(requests), StatusPublisher(status)
        # Settlement news for the dispatcher since the last status: ids inserted, and the groups
        # the learner reports trained (with the version of that step).
        self._inserted_ids: list[str] = []
        self._trained: list[tuple[int, list[str]]] = []
        self._ledgered = 0  # of _inserted_ids, how many the ledger has
        self.ledger = None
        self._last_status = 0.0
        self._reported_drops: Counter[str] = Counter()
        self._insert_blocked_since: float | None = None
        self._last_blocked_log = 0.0
        self._last_wake = time.monotonic()
        self.max_staleness: int | None = None  # the bound the learner last set (under auto)

    @property
    def bad_requests(self) -> int:
        return self.batches.bad_requests

    @property
    def rejected_frames(self) -> int:
        return self.inbox.rejected + self.bad_requests

    def serve(self, stop) -> None:
        while not stop():
            self.step(max_wait=0.1)

    def step(self, max_wait: float) -> None:
        now = time.monotonic()
        self._count_held_time(now)
        insert_open = self.buf.can_insert()
        self._track_blocked(insert_open, now)
        ready = self._wait(insert_open, max_wait, now)
        changed = False
        if ready.get(self.inbox.sock):
            changed |= self.take_inserts()
        if ready.get(self.requests.sock):
            changed |= self.take_requests()
        changed |= self.serve_held(time.monotonic())
        self._write_ledger()
        self.publish(changed)

    def _count_held_time(self, now: float) -> None:
        """Time since the last wake-up counts as held for each side that was held during it."""
        elapsed, self._last_wake = now - self._last_wake, now
        if self._insert_blocked_since is not None:
            m.BUFFER_RATE_LIMITED_SECONDS.labels("insert").inc(elapsed)
        if self.batches.held:
            m.BUFFER_RATE_LIMITED_SECONDS.labels("sample").inc(elapsed)

    def _wait(self, insert_open: bool, max_wait: float, now: float) -> dict:
        """Until a socket has work, the next held deadline, or ``max_wait`` s."""
        poller = zmq.Poller()
        poller.register(self.requests.sock, zmq.POLLIN)
        if insert_open:
            poller.register(self.inbox.sock, zmq.POLLIN)
        wait = max_wait
        if (deadline := self.batches.next_deadline()) is not None:
            wait = max(0.0, min(wait, deadline - now))
        return dict(poller.poll(int(wait * 1000)))

    def take_inserts(self) -> bool:
        inserted = False
        for _ in range(INSERTS_PER_WAKE):
            if not self.buf.can_insert():
                break
            group = self.intake.take(timeout=0)
            if group is None:
                break
            self._insert(group)
            inserted = True
        return inserted

    def _insert(self, group) -> None:
        if self.buf.insert(group) is not None:
            self._inserted_ids.append(group.group_id)

    def take_requests(self) -> bool:
        taken = False
        for client, message in self.batches.take():
            taken = True
            request = self.batches.admit(message)
            if request is not None:
                self._apply(request)
                self.batches.hold(client, request)
        return taken

    def _apply(self, request: WantBatch) -> None:
        """What rides on a request: priority updates, the groups trained, the bound the learner set
        and its version (the bound first: a lowered one drops what it makes stale at that version)."""
        updates = request.priority_updates
        if updates is not None and (updates.group_keys or updates.priorities):
            try:
                self.buf.update_priorities(updates.group_keys, updates.priorities)
            except (TypeError, ValueError, KeyError) as e:
                self.batches.reject("bad_priorities", str(e))
        trained = request.trained
        if trained is not None:
            version = request.policy_version if trained.version is None else trained.version
            self._trained.append((version, list(trained.group_ids)))
        if request.max_staleness is not None and request.max_staleness != self.max_staleness:
            self.buf.staleness.set_bound(request.max_staleness)
            self.max_staleness = request.max_staleness
            m.STALENESS_BOUND.labels("buffer").set(request.max_staleness)
        self.buf.set_learner_version(request.policy_version)

    def serve_held(self, now: float) -> bool:
        served = False
        waiting = []
        for h in self.batches.held:
            if self.buf.can_sample(h.num_groups):
                batch = self.buf.sample(h.num_groups)
                if self.buf.partial_rollouts != "off":  # the version the learner trains this batch at
                    mark_trained_from(list(batch.items), self.buf.learner_version, self.buf.staleness.max_staleness)
                first = int(batch.first_time.sum())
                m.BUFFER_SAMPLED.labels("first").inc(first)
                m.BUFFER_SAMPLED.labels("repeat").inc(len(batch) - first)
                reply = Batch(
                    groups=list(batch.items),
                    group_keys=batch.keys.tolist(),
                    probabilities=batch.probabilities.tolist(),
                    is_weights=batch.is_weights.tolist(),
                    repeat=(~batch.first_time).tolist(),
                )
                self.batches.answer(h, reply)
                served = True
            elif now >= h.deadline:
                self.batches.answer(h, Batch())
            else:
                waiting.append(h)
        self.batches.held = waiting
        return served

    def _track_blocked(self, insert_open: bool, now: float) -> None:
        if insert_open:
            self._insert_blocked_since = None
            return
        if self._insert_blocked_since is None:
            self._insert_blocked_since = now
        if now - self._insert_blocked_since > BLOCKED_WARN_S and now - self._last_blocked_log > BLOCKED_WARN_S:
            self._last_blocked_log = now
            log.warning(
                "buffer: inserts held by the rate limiter for %.0f s: %s",
                now - self._insert_blocked_since,
                self.buf.rate_limiter.why_blocked(),
            )

    def _write_ledger(self) -> None:
        if self._inserted_ids and self.ledger is not None:
            self.ledger.write("inserted", self._inserted_ids[self._ledgered :])
            self._ledgered = len(self._inserted_ids)

    def publish(self, changed: bool) -> None:
        now = time.monotonic()
        if not changed and now - self._last_status < STATUS_EVERY_S:
            return
        buf = self.buf
        dropped_ids = getattr(buf.observer, "dropped_ids", [])
        self.news.publish(
            BufferStatus(
                learner_version=buf.learner_version,
                dropped_groups=buf.dropped_groups,
                held_groups=len(buf),
                inserted=self._inserted_ids,
                dropped=list(dropped_ids),
                trained=self._trained,
                max_staleness=self.max_staleness,
            )
        )
        self._inserted_ids, self._trained = [], []
        self._ledgered = 0
        dropped_ids.clear()
        self._last_status = now
        m.BUFFER_GROUPS.set(len(buf))
        m.BUFFER_SAMPLES.set(buf.storage.samples)
        m.BUFFER_BYTES.set(buf.storage.bytes)
        m.POLICY_VERSION.set(buf.learner_version)
        for reason, n in buf.dropped.items():
            m.DROPPED.labels(reason).inc(n - self._reported_drops[reason])
            self._reported_drops[reason] = n

    def drain(self, timeout: float = 0.2) -> None:
        """Take what producers flushed on their way out, whatever the rate limiter says: at the
        end every group must be accounted for."""
        for group in self.intake.pending(timeout):
            self._insert(group)
        self.publish(True)
