"""The buffer's three process boundaries: groups in, learners' batch requests, status out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from asyncrl.observability import metrics as m
from asyncrl.wire.messages import Batch, BufferStatus, GroupMessage, Message, WantBatch
from asyncrl.wire.schema import Group
from asyncrl.wire.sockets import Publisher, ReplyServer, StreamReceiver

log = logging.getLogger(__name__)

REPLY_MARGIN_S = 0.25
"""A held request is answered (empty if need be) this long before its learner stops waiting for it."""
MAX_HELD = 64
"""Held learner requests at most: a runaway client cannot grow the list."""


class GroupIntake:
    """Scored groups from the reward workers (``group``, PULL bound at ``buffer_in``).

    Blocks: never (``take`` waits at most its timeout). While the rate limiter forbids inserts the
    service does not read this socket: frames pile up to its high-water mark and then the reward
    workers' sends block, so backpressure reaches the producers and nothing grows. Dropped: frames
    that fail validation and frames of other kinds (counted in ``asyncrl_rejected_frames``).
    """

    def __init__(self, sock: StreamReceiver):
        self.sock = sock

    def take(self, timeout: float) -> Group | None:
        """The next group, or None when no frame came within ``timeout`` s (or it was not a group)."""
        msg = self.sock.recv(timeout=timeout)
        return msg[1].group if msg is not None and isinstance(msg[1], GroupMessage) else None

    def pending(self, timeout: float) -> Iterator[Group]:
        """Every group still arriving, each waited for up to ``timeout`` s."""
        while (msg := self.sock.recv(timeout=timeout)) is not None:
            if isinstance(msg[1], GroupMessage):
                yield msg[1].group


@dataclass
class HeldRequest:
    client: bytes
    request_id: int | None
    num_groups: int
    deadline: float


class BatchRequests:
    """Learners' ``want_batch`` (ROUTER bound at ``buffer_requests``), held until served with a ``batch``.

    Blocks: never: reading takes what is queued, and a reply is queued to ZeroMQ. Dropped: a request
    that fails validation (``bad_request``: the codec), of another kind (``bad_kind``) or past
    ``MAX_HELD`` held ones (``too_many_requests``), each counted and logged once per reason, never
    answered; a reply to a learner that has gone (ROUTER drops it). A held request is answered,
    empty if need be, ``REPLY_MARGIN_S`` before its deadline: never left unanswered.
    """

    def __init__(self, sock: ReplyServer):
        self.sock = sock
        self.held: list[HeldRequest] = []
        self.refused = 0
        self._logged: set[str] = set()

    @property
    def bad_requests(self) -> int:
        """Requests rejected, by the codec or here."""
        return self.sock.rejected + self.refused

    def take(self) -> Iterator[tuple[bytes, Message]]:
        """Every request already queued: (client, message)."""
        while (req := self.sock.recv(timeout=0)) is not None:
            yield req[0], req[2]

    def admit(self, message: Message) -> WantBatch | None:
        """The request if it may be held; None (rejected, counted) if not."""
        if not isinstance(message, WantBatch):
            self.reject("bad_kind", f"{message.kind!r} is not a request the buffer serves")
            return None
        if len(self.held) >= MAX_HELD:
            self.reject("too_many_requests", f"{len(self.held)} requests are already held (at most {MAX_HELD})")
            return None
        return message

    def hold(self, client: bytes, request: WantBatch) -> None:
        deadline = time.monotonic() + request.timeout_s - REPLY_MARGIN_S
        self.held.append(HeldRequest(client, request.request_id, request.num_groups, deadline))

    def answer(self, held: HeldRequest, batch: Batch) -> None:
        self.sock.reply(held.client, batch, held.request_id)

    def next_deadline(self) -> float | None:
        return min(h.deadline for h in self.held) if self.held else None

    def reject(self, reason: str, detail: str) -> None:
        self.refused += 1
        m.REJECTED_FRAMES.labels(self.sock.name, reason).inc()
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "buffer: rejected a request (%s: %s); further %r rejections are only counted", reason, detail, reason
            )


class StatusPublisher:
    """``buffer_status`` to the dispatcher (PUB bound at ``buffer_status``).

    Blocks: never. Dropped: statuses past a subscriber's high-water mark, and every status sent
    before a subscriber joined; the service publishes after every change and every second.
    """

    def __init__(self, sock: Publisher):
        self.sock = sock

    def publish(self, status: BufferStatus) -> None:
        self.sock.send(status)
