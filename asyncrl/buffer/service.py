"""The buffer process: scored groups in (PULL), batches out on request (ROUTER), status out (PUB).

Backpressure: while the storage is full the service stops reading its input, so the reward
workers' sends block at their high-water mark instead of the buffer growing.

A learner's ``want_batch`` carries its version; the request is held until ``num_groups`` groups
pass the staleness gate, then answered, or answered empty at its deadline so the learner can log
what it waits for and ask again. After every change the service publishes ``buffer_status``
(learner version, groups dropped) for the dispatcher's admission rule, and repeats it every
second for late subscribers.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.metrics import BUFFER_GROUPS, BUFFER_SAMPLES, DROPPED, POLICY_VERSION
from asyncrl.transport import Publisher, ReplyServer, StreamReceiver
from asyncrl.wire import group_to_dict

log = logging.getLogger(__name__)


def run_buffer(ctx) -> None:
    buf = ReplayBuffer(ctx.cfg.buffer)
    inbox = StreamReceiver(ctx.endpoints.buffer_in, name="buffer.in")
    requests = ReplyServer(ctx.endpoints.buffer_requests, name="buffer.requests")
    status = Publisher(ctx.endpoints.buffer_status, name="buffer.status")
    learner_version = 0
    pending = None  # (client, request_id, num_groups, deadline): one learner for now
    last_status = 0.0
    reported_drops: Counter[str] = Counter()
    ctx.emit("ready")
    while not ctx.stop_requested():
        changed = False
        if buf.has_room(ctx.cfg.sampling.n):
            msg = inbox.recv(timeout=0.02)
            if msg is not None and msg[0] == "group":
                buf.insert(msg[1]["group"])
                changed = True
        req = requests.recv(timeout=0 if pending else 0.02)
        if req is not None and req[1] == "want_batch":
            client, _kind, body = req
            learner_version = max(learner_version, int(body.get("policy_version", 0)))
            deadline = time.monotonic() + float(body.get("timeout_s", 5.0)) - 0.25
            pending = (client, body.get("request_id"), int(body.get("num_groups", 1)), deadline)
            changed = True
        if pending is not None:
            client, rid, k, deadline = pending
            if buf.ready(k, learner_version):
                groups = buf.sample(k, learner_version)
                requests.reply(client, "batch", {"groups": [group_to_dict(g) for g in groups]}, rid)
                pending = None
                changed = True
            elif time.monotonic() > deadline:
                pending = None  # the learner has given up on this request and will ask again
        now = time.monotonic()
        if changed or now - last_status > 1.0:
            status.send("buffer_status", {"learner_version": learner_version,
                                          "dropped_groups": buf.dropped_groups, "held_groups": len(buf.storage)})
            last_status = now
            BUFFER_GROUPS.set(len(buf.storage))
            BUFFER_SAMPLES.set(buf.storage.num_samples)
            POLICY_VERSION.set(learner_version)
            for reason, n in buf.dropped.items():
                DROPPED.labels(reason).inc(n - reported_drops[reason])
                reported_drops[reason] = n
    # Take what the reward worker flushed on its way out, then account for everything.
    while (msg := inbox.recv(timeout=0.2)) is not None:
        if msg[0] == "group":
            buf.insert(msg[1]["group"])
    ctx.emit("final", **buf.reconcile(), rejected_frames=inbox.rejected + requests.rejected)
    for sock in (inbox, requests, status):
        sock.close()
