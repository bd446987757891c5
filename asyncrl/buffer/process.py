"""The buffer process: scored groups in (PULL), batches out on request (ROUTER), status out (PUB).

One loop, one thread, blocked in ``zmq.Poller`` until a socket has work or a held request's
deadline comes; never a busy loop.

- Inserts. While the rate limiter forbids an insert, the input socket is not polled: frames pile
  up to its high-water mark and then the reward workers' sends block (and warn on their own
  timeouts), so backpressure reaches the producers and nothing grows. Past capacity the oldest
  groups are evicted (FIFO), never the newcomer.
- Batches. A learner's ``want_batch`` (``num_groups``, ``policy_version``, ``timeout_s``, and
  optionally ``priority_updates`` for the groups of its previous batch) feeds the learner
  version to the staleness gate and is held until ``num_groups`` groups may be sampled, then
  answered with the groups, their buffer keys, P(i) and importance weights; or answered empty
  just before its deadline, so the learner logs what it waits for and asks again. Several
  learners may hold requests at once; they are served in arrival order.
- Status. After every change, and every second for late subscribers, ``buffer_status`` carries
  the learner version and the groups retired untrained, for the dispatcher's admission rule.

A malformed request or priority update is rejected, counted in ``asyncrl_rejected_frames``
and logged once per reason; the service keeps serving.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import zmq

from asyncrl.buffer.context import BufferContext
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.observability import metrics as m
from asyncrl.wire.schema import group_to_dict
from asyncrl.wire.sockets import Publisher, ReplyServer, StreamReceiver

log = logging.getLogger(__name__)

REPLY_MARGIN_S = 0.25  # answer a held request this long before the learner stops waiting for it
INSERTS_PER_WAKE = 64  # inserts taken per wake-up before requests are looked at again
BLOCKED_WARN_S = 30.0
MAX_HELD = 64  # held learner requests at most: a runaway client cannot grow the list


class BufferMetrics:
    """The buffer's observer: feeds the Prometheus metrics of ``asyncrl.observability.metrics``, and collects the
    ids of dropped groups for the group ledger and the dispatcher's status report."""

    def __init__(self, ledger=None):
        self.ledger = ledger
        self.dropped_ids: list[str] = []

    def on_drop_groups(self, group_ids: list[str], reason: str) -> None:
        if reason != "duplicate":  # a dropped copy settles nothing: the original goes on
            self.dropped_ids.extend(group_ids)
        if self.ledger is not None:
            self.ledger.write("dropped", group_ids, reason=reason)

    def on_insert(self, priorities) -> None:
        m.BUFFER_INSERTED.inc(len(priorities))
        for p in priorities:
            m.BUFFER_PRIORITY.observe(float(p))

    def on_sample(self, age_versions, age_s, samples) -> None:
        for v, s in zip(age_versions.tolist(), age_s.tolist()):
            m.BUFFER_SAMPLE_AGE_VERSIONS.observe(v)
            m.BUFFER_SAMPLE_AGE_SECONDS.observe(s)

    def on_remove(self, reason: str, samples: int) -> None:
        m.BUFFER_REMOVED.labels(reason).inc(samples)


@dataclass
class _Held:
    client: bytes
    request_id: int | None
    num_groups: int
    deadline: float


class BufferService:
    """The loop around a ``ReplayBuffer``; ``step`` is one wake-up (tests drive it in a thread)."""

    def __init__(self, buf: ReplayBuffer, inbox: StreamReceiver, requests: ReplyServer, status: Publisher):
        self.buf = buf
        # Settlement news for the dispatcher since the last status: ids inserted, and the groups
        # the learner reports trained (with the version of that step).
        self._inserted_ids: list[str] = []
        self._trained: list[list] = []
        self._ledgered = 0  # of _inserted_ids, how many the ledger has
        self.ledger = None
        self.inbox, self.requests, self.status = inbox, requests, status
        self.held: list[_Held] = []
        self.bad_requests = 0
        self._logged: set[str] = set()
        self._last_status = 0.0
        self._reported_drops: Counter[str] = Counter()
        self._insert_blocked_since: float | None = None
        self._last_blocked_log = 0.0
        self._last_wake = time.monotonic()

    def serve(self, stop) -> None:
        while not stop():
            self.step(max_wait=0.1)

    def step(self, max_wait: float) -> None:
        now = time.monotonic()
        # Time since the last wake-up counts as held for each side that was held during it.
        elapsed, self._last_wake = now - self._last_wake, now
        if self._insert_blocked_since is not None:
            m.BUFFER_RATE_LIMITED_SECONDS.labels("insert").inc(elapsed)
        if self.held:
            m.BUFFER_RATE_LIMITED_SECONDS.labels("sample").inc(elapsed)
        insert_open = self.buf.can_insert()
        self._track_blocked(insert_open, now)
        poller = zmq.Poller()
        poller.register(self.requests.sock, zmq.POLLIN)
        if insert_open:
            poller.register(self.inbox.sock, zmq.POLLIN)
        wait = max_wait
        if self.held:
            wait = max(0.0, min(wait, min(h.deadline for h in self.held) - now))
        ready = dict(poller.poll(int(wait * 1000)))
        changed = False
        if ready.get(self.inbox.sock):
            for _ in range(INSERTS_PER_WAKE):
                if not self.buf.can_insert():
                    break
                msg = self.inbox.recv(timeout=0)
                if msg is None:
                    break
                if msg[0] == "group":
                    self._insert(msg[1]["group"])
                    changed = True
        if ready.get(self.requests.sock):
            while (req := self.requests.recv(timeout=0)) is not None:
                self._on_request(*req)
                changed = True
        changed |= self._serve_held(time.monotonic())
        if self._inserted_ids and getattr(self, "ledger", None) is not None:
            self.ledger.write("inserted", self._inserted_ids[self._ledgered :])
            self._ledgered = len(self._inserted_ids)
        self._publish(changed)

    def _insert(self, group) -> None:
        if self.buf.insert(group) is not None:
            self._inserted_ids.append(group.group_id)

    def _on_request(self, client: bytes, kind: str, body: dict) -> None:
        if kind != "want_batch":
            self._reject("bad_kind", f"{kind!r} is not a request the buffer serves")
            return
        if len(self.held) >= MAX_HELD:
            self._reject("too_many_requests", f"{len(self.held)} requests are already held (at most {MAX_HELD})")
            return
        try:
            num_groups = int(body.get("num_groups", 1))
            version = int(body.get("policy_version", 0))
            timeout_s = float(body.get("timeout_s", 5.0))
            if num_groups < 1 or version < 0:
                raise ValueError(f"num_groups ({num_groups}) must be >= 1 and policy_version ({version}) >= 0")
            if not 0 < timeout_s < math.inf:
                raise ValueError(f"timeout_s ({timeout_s}) must be a finite number > 0: nothing waits forever")
        except (TypeError, ValueError) as e:
            self._reject("bad_request", str(e))
            return
        updates = body.get("priority_updates")
        if updates:
            try:
                self.buf.update_priorities(updates["group_keys"], updates["priorities"])
            except (TypeError, ValueError, KeyError) as e:
                self._reject("bad_priorities", str(e))
        trained = body.get("trained")
        if isinstance(trained, dict) and isinstance(trained.get("group_ids"), list):
            self._trained.append([int(trained.get("version", version)), [str(g) for g in trained["group_ids"]]])
        self.buf.set_learner_version(version)
        deadline = time.monotonic() + timeout_s - REPLY_MARGIN_S
        self.held.append(_Held(client, body.get("request_id"), num_groups, deadline))

    def _serve_held(self, now: float) -> bool:
        served = False
        waiting = []
        for h in self.held:
            if self.buf.can_sample(h.num_groups):
                batch = self.buf.sample(h.num_groups)
                m.BUFFER_SAMPLED.labels("first").inc(int(batch.first_time.sum()))
                m.BUFFER_SAMPLED.labels("repeat").inc(len(batch) - int(batch.first_time.sum()))
                body = {
                    "groups": [group_to_dict(g) for g in batch.items],
                    "group_keys": batch.keys.tolist(),
                    "probabilities": batch.probabilities.tolist(),
                    "is_weights": batch.is_weights.tolist(),
                }
                self.requests.reply(h.client, "batch", body, h.request_id)
                served = True
            elif now >= h.deadline:
                self.requests.reply(h.client, "batch", {"groups": []}, h.request_id)
            else:
                waiting.append(h)
        self.held = waiting
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

    def _reject(self, reason: str, detail: str) -> None:
        self.bad_requests += 1
        m.REJECTED_FRAMES.labels(self.requests.name, reason).inc()
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "buffer: rejected a request (%s: %s); further %r rejections are only counted", reason, detail, reason
            )

    def _publish(self, changed: bool) -> None:
        now = time.monotonic()
        if not changed and now - self._last_status < 1.0:
            return
        buf = self.buf
        dropped_ids = getattr(buf.observer, "dropped_ids", [])
        self.status.send(
            "buffer_status",
            {
                "learner_version": buf.learner_version,
                "dropped_groups": buf.dropped_groups,
                "held_groups": len(buf),
                "inserted": self._inserted_ids,
                "dropped": list(dropped_ids),
                "trained": self._trained,
            },
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
        while (msg := self.inbox.recv(timeout=timeout)) is not None:
            if msg[0] == "group":
                self._insert(msg[1]["group"])
        self._publish(True)

    @property
    def rejected_frames(self) -> int:
        return self.inbox.rejected + self.requests.rejected + self.bad_requests


def run_buffer(ctx: BufferContext) -> None:
    buf = ReplayBuffer.from_config(
        ctx.cfg.buffer,
        observer=BufferMetrics(ctx.ledger),
        drop_truncated=ctx.cfg.algorithm.truncation.mode == "drop",
    )
    if ctx.resume_dir is not None:
        buf.restore(ctx.resume_dir / "buffer")
        log.info("buffer: restored %d groups from %s", len(buf), ctx.resume_dir)
    inbox = StreamReceiver(ctx.endpoints.buffer_in, name="buffer.in")
    requests = ReplyServer(ctx.endpoints.buffer_requests, name="buffer.requests")
    status = Publisher(ctx.endpoints.buffer_status, name="buffer.status")
    service = BufferService(buf, inbox, requests, status)
    service.ledger = ctx.ledger
    ctx.emit("ready")

    def stop_or_command() -> bool:
        for command in ctx.commands():
            if command.get("command") == "checkpoint":
                save_checkpoint_part(buf, Path(command["dir"]))
                ctx.emit("checkpoint_part", part="buffer", version=command["version"])
        return ctx.stop_requested()

    service.serve(stop_or_command)
    service.drain()
    ctx.ledger.write("held", buf.held_group_ids())
    if ctx.cfg.buffer.snapshot_on_exit:
        buf.snapshot(ctx.run_dir / "buffer_snapshot")
    ctx.emit(
        "final",
        **buf.reconcile(),
        removed=dict(buf.removed),
        rejected_frames=service.rejected_frames,
        priority_updates_ignored=buf.priority_updates_ignored,
    )
    for sock in (inbox, requests, status):
        sock.close()


def save_checkpoint_part(buf: ReplayBuffer, stage: Path) -> None:
    """The buffer's part of a checkpoint: its snapshot and the ids of the groups it holds (which
    the dispatcher then need not hand out again on resume). Idempotent: the controller repeats
    the command until it hears back."""
    if (stage / "buffer").exists():
        return
    buf.snapshot(stage / "buffer")
    ids = stage / "buffer" / "buffer_ids.json"
    ids.write_text(json.dumps(buf.stored_group_ids()))
