"""The dispatcher's two process boundaries: prompt requests from generators, status from the buffer."""

from __future__ import annotations

import time
from dataclasses import dataclass

from asyncrl.wire.messages import BufferStatus, PromptRow, Prompts, WantPrompts
from asyncrl.wire.sockets import ReplyServer, Subscriber

REPLY_MARGIN_S = 0.05
"""A request is answered only this long before its generator stops waiting for it, at the latest."""
MAX_READ = 1000
"""Requests read per turn at most: a flood of them cannot hold the loop."""


@dataclass
class PendingRequest:
    """A generator's request for prompts, held until it can be served or its deadline passes."""

    client: bytes
    request_id: int | None
    generator: str
    max_prompts: int
    policy_version: int
    deadline: float


class PromptRequests:
    """Generators ask for prompts (``want_prompts``, ROUTER bound at ``dispatcher``); replies are ``prompts``.

    Blocks: ``take`` waits at most ``wait`` seconds for the first request; replies never block.
    Dropped: a held request whose deadline passes (its generator stopped waiting and asks again);
    an older request of a generator that asks again (a generator waits on one request at a time);
    frames of other kinds; a reply to a generator that has gone or is at its high-water mark
    (ROUTER drops it: its rows come back when their lease runs out).
    """

    def __init__(self, address: str, name: str = "dispatcher.requests"):
        self.server = ReplyServer(address, name=name)
        self.pending: list[PendingRequest] = []

    def take(self, wait: float) -> list[tuple[bytes, WantPrompts]]:
        """Every request already queued, the first waited for up to ``wait`` s. All are read before
        any is served: a generator that asked again while the dispatcher was busy (or before go) is
        answered once, not once per ask, else the extra answers queue up in its socket and it lags
        a few batches behind."""
        out: list[tuple[bytes, WantPrompts]] = []
        msg = self.server.recv(timeout=wait)
        while msg is not None:
            if isinstance(msg[2], WantPrompts):
                out.append((msg[0], msg[2]))
            if len(out) >= MAX_READ:
                break
            msg = self.server.recv(timeout=0)
        return out

    def hold(self, client: bytes, request: WantPrompts, learner_version: int) -> None:
        """Hold ``request``, replacing its generator's older ones."""
        held = PendingRequest(
            client,
            request.request_id,
            request.generator,
            max(1, request.max_prompts),
            learner_version if request.policy_version is None else request.policy_version,
            time.monotonic() + request.timeout_s - REPLY_MARGIN_S,
        )
        self.pending = [p for p in self.pending if p.generator != held.generator] + [held]

    def expire(self, now: float) -> None:
        self.pending = [p for p in self.pending if p.deadline > now]

    def answer(self, request: PendingRequest, rows: list[PromptRow], learner_version: int | None = None) -> None:
        """Reply and stop holding ``request``; no rows with ``learner_version``: load newer weights."""
        self.pending.remove(request)
        self.server.reply(request.client, Prompts(prompts=rows, learner_version=learner_version), request.request_id)

    def close(self) -> None:
        self.server.close()


class BufferStatusFeed:
    """The buffer's ``buffer_status`` (SUB to its PUB): the learner's version and groups settled.

    Blocks: never (``latest`` reads what is queued). Dropped: statuses past the subscriber's
    high-water mark or published before it joined. A missed status only delays what it says: the
    buffer publishes its version every second, and a group whose news was lost goes out again when
    its lease runs out (its id keeps the copy from being trained twice).
    """

    def __init__(self, address: str, name: str = "dispatcher.buffer_status"):
        self.sub = Subscriber(address, name=name)

    def latest(self) -> list[BufferStatus]:
        return [body for _kind, body in self.sub.recv_latest() if isinstance(body, BufferStatus)]

    def close(self) -> None:
        self.sub.close()
