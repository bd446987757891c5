"""The reward worker process: groups in, scored (or unscored-with-reason) groups out to the buffer.

One asyncio loop per process scores up to ``reward.concurrency`` groups at once (each reward of
``reward.rewards`` may itself run many HTTP requests per group), so a slow judge does not
serialize the stream. Queues are bounded: at most ``queue_groups`` groups wait to be scored; past
that the worker stops reading its input and ZeroMQ's high-water marks push back on the senders.

**How several workers share the stream (hot plug).** The first worker (``reward-0``, started by
the controller) *owns* the input: it binds the PULL at ``reward_in`` that every generator pushes
to, as before. It also binds a ROUTER at ``reward_share``. A hot-plugged worker
(``asyncrl reward-worker --connect RUN_DIR``) connects a DEALER there and asks for work —
``want_groups {max_groups: free slots}`` — whenever it has room; the owner replies at once with
up to that many groups from its waiting queue (possibly none). So work is pulled, never pushed:

- nothing is queued towards a worker that did not ask, so a worker that leaves or dies loses at
  most what it was already scoring, and a leaving worker loses nothing: on SIGTERM/SIGINT or a
  stop it stops asking, waits for the reply to its last request, finishes and forwards every group
  it holds, reports its final counters to the controller, and exits;
- the owner's ROUTER is ``ROUTER_MANDATORY``: a reply to a peer that has gone raises instead of
  vanishing, and the groups go back to the owner's queue;
- idle workers take work in proportion to their free slots; the owner scores what nobody takes.

What blocks: the owner reading ``reward_in`` (stops while its queue is full), every worker's PUSH
to the buffer (a group waits in the worker, counted as held, until the buffer takes it; intake
pauses meanwhile). What is dropped: nothing in the worker. A group some reward left unscored
(after the HTTP client's retries) is either forwarded unscored — the buffer drops it, counted by
``meta['unscored_reason']`` — (``on_failure: drop``) or scored again later, up to
``max_requeues`` times, then forwarded unscored (``on_failure: requeue``).

Ledger (``asyncrl.controller.accounting``): each worker reports ``received`` = samples it took to score
(the owner: from generators, minus what it handed to peers; a peer: what it was handed),
``forwarded`` to the buffer and ``held`` at exit, so the sums over role ``reward`` reconcile with
any number of workers that came and went.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import zmq
from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.observability.metrics import REWARD_QUEUE_DEPTH, REWARD_SECONDS, SAMPLES
from asyncrl.rewards.base import Reward, score_greedy_baseline, score_with
from asyncrl.rewards.context import RewardContext
from asyncrl.rewards.registry import RewardSpec, build_reward
from asyncrl.wire.schema import Group, encode, encode_group, group_to_dict
from asyncrl.wire.sockets import ReplyServer, RequestClient, StreamReceiver, StreamSender

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.1
"""Seconds between a busy or leaving hot-plugged worker's reports of what it holds."""


class RewardConfig(Config):
    drain_s: float = Field(1.0, gt=0)
    """On stop, seconds of silence on the input after which the worker has drained and exits."""
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(kind="exact_match")])
    """The rewards and their weights: reward = Σ weight_i · reward_i (see ``rewards.base``; kinds in ``rewards.registry``)."""
    concurrency: int = Field(64, ge=1)
    """Groups scored at once by one worker."""
    queue_groups: int = Field(256, ge=1)
    """Groups taken in and waiting to be scored at most; past it the worker stops reading its input."""
    on_failure: Literal["drop", "requeue"] = "drop"
    """A group left unscored: forward it unscored (the buffer drops it, counted) or score it again later."""
    max_requeues: int = Field(3, ge=0)
    """With on_failure=requeue: times a group is scored again before it is forwarded unscored."""
    requeue_delay_s: float = Field(2.0, ge=0)
    """With on_failure=requeue: seconds before a group is scored again."""
    request_timeout_s: float = Field(5.0, gt=0)
    """A hot-plugged worker's wait for the owner's reply to a request for work."""


@dataclass
class _Waiting:
    group: Group
    ready_at: float = 0.0
    requeues: int = 0


class RewardWorker:
    """The loop shared by the owner and hot-plugged workers; ``intake`` is what differs."""

    def __init__(self, ctx: RewardContext, rewards: list[tuple[Reward, float]], owner: bool):
        self.ctx = ctx
        self.cfg: RewardConfig = ctx.cfg.reward
        self.rewards = rewards
        self.owner = owner
        self.outbox = StreamSender(ctx.endpoints.buffer_in, name=f"{ctx.name}.out")
        self.waiting: deque[_Waiting] = deque()
        self.running: dict[asyncio.Task, Group] = {}
        self.outgoing: deque[Group] = deque()
        self.taken = self.handed_out = self.forwarded = self.requeued = self.unscored = 0
        self.leave = False
        self.crash: BaseException | None = None
        self.last_input = time.monotonic()
        self.send_blocked_since: float | None = None
        if owner:
            self.inbox = StreamReceiver(ctx.endpoints.reward_in, name="reward.in")
            self.share = (
                ReplyServer(ctx.endpoints.reward_share, name="reward.share") if ctx.endpoints.reward_share else None
            )
            if self.share is not None:
                self.share.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        else:
            if not ctx.endpoints.reward_share:
                raise ValueError(
                    "this run's endpoints.json has no reward_share address: its reward worker cannot share"
                )
            self.client = RequestClient(ctx.endpoints.reward_share, name=f"{ctx.name}.share")
            self.asked_at: float | None = None  # a request for work is outstanding since then
            self.heartbeat_at = 0.0
        self.peers: dict[bytes, tuple[int, float]] = {}  # owner: peer -> (samples it holds, last heard)

    # -- counts ---------------------------------------------------------------------------------

    def held(self) -> int:
        groups = [w.group for w in self.waiting] + list(self.outgoing)
        return sum(len(g.samples) for g in groups) + sum(len(g.samples) for g in self.running.values())

    def final_counts(self) -> dict:
        return {
            "received": self.taken - self.handed_out,
            "forwarded": self.forwarded,
            "held": self.held(),
            "handed_out": self.handed_out,
            "requeued": self.requeued,
            "unscored": self.unscored,
            "rejected_frames": self.inbox.rejected if self.owner else self.client.rejected,
        }

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        self.ctx.emit("ready")
        while True:
            if self.crash is not None:
                raise self.crash
            stopping = self.ctx.stop_requested() or self.leave
            self._flush()
            if not self.outgoing:
                self._intake(stopping)
            self._start()
            REWARD_QUEUE_DEPTH.labels("waiting").set(len(self.waiting))
            REWARD_QUEUE_DEPTH.labels("scoring").set(len(self.running))
            REWARD_QUEUE_DEPTH.labels("to_buffer").set(len(self.outgoing))
            if stopping and self._drained():
                break
            if self.running:
                await asyncio.wait(list(self.running), timeout=0.005, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(0.005)
        if not self.owner:
            self._ask(0, leaving=True)  # the owner forgets this worker; its empty reply is not needed
        for reward, _w in self.rewards:
            await reward.close()

    def _drained(self) -> bool:
        if self.waiting or self.running or self.outgoing:
            return False
        now = time.monotonic()
        if self.owner:
            # Peers still scoring what it handed them forward to the buffer: wait for them (a
            # peer silent for 2 request timeouts is taken as gone), so the buffer outlives them.
            busy_peers = [
                p
                for p, (holding, seen) in self.peers.items()
                if holding and now - seen < 2 * self.cfg.request_timeout_s
            ]
            return now - self.last_input > self.cfg.drain_s and not busy_peers
        return self.asked_at is None or time.monotonic() - self.asked_at > self.cfg.request_timeout_s

    def _room(self) -> int:
        return self.cfg.queue_groups - len(self.waiting)

    def _intake(self, stopping: bool) -> None:
        if self.owner:
            while self._room() > 0 and (msg := self.inbox.recv(timeout=0)) is not None:
                self.last_input = time.monotonic()
                if msg[0] == "group":
                    self._take(msg[1]["group"])
            if self.share is not None:
                self._serve_peers()
            return
        # A hot-plugged worker: collect any reply, then ask for as many groups as it has free slots,
        # or (full, or leaving) ask for none: a heartbeat that tells the owner what it still holds.
        while (msg := self.client.receive(timeout=0)) is not None:
            self.asked_at = None
            for group in msg[1].get("groups", []) if msg[0] == "groups" else []:
                self._take(group)
        now = time.monotonic()
        free = 0 if stopping else self.cfg.concurrency - len(self.running) - len(self.waiting)
        overdue = self.asked_at is not None and now - self.asked_at > self.cfg.request_timeout_s
        if (self.asked_at is None or overdue) and (free > 0 or now - self.heartbeat_at > HEARTBEAT_S):
            self._ask(free)

    def _ask(self, max_groups: int, leaving: bool = False) -> None:
        body = {"max_groups": max_groups, "holding": self.held(), "leaving": leaving, "worker": self.ctx.name}
        try:
            self.client.sock.send(encode("want_groups", body), zmq.NOBLOCK)
        except zmq.Again:  # the owner is not there (yet): ask again on a later turn
            return
        self.asked_at = self.heartbeat_at = time.monotonic()

    def _take(self, group: Group) -> None:
        self.taken += len(group.samples)
        self.waiting.append(_Waiting(group))

    def _serve_peers(self) -> None:
        while (req := self.share.recv(timeout=0)) is not None:
            client, kind, body = req
            if kind == "want_run":  # a worker joining by address learns the run from us
                run = {"config": self.ctx.cfg.model_dump(mode="json"), "endpoints": self.ctx.endpoints.model_dump()}
                self.share.reply(client, "run", run, body.get("request_id"))
                continue
            if kind != "want_groups":
                continue
            now = time.monotonic()
            self.peers[client] = (int(body.get("holding", 0)), now)
            if body.get("leaving"):
                self.peers.pop(client)
            given = []
            while self.waiting and len(given) < int(body.get("max_groups", 1)) and self.waiting[0].ready_at <= now:
                given.append(self.waiting.popleft())
            try:
                self.share.reply(client, "groups", {"groups": [group_to_dict(w.group) for w in given]}, None)
            except zmq.ZMQError:  # the peer is gone (ROUTER_MANDATORY) or full: keep its groups
                self.waiting.extendleft(reversed(given))
                continue
            samples = sum(len(w.group.samples) for w in given)
            self.handed_out += samples
            if samples and client in self.peers:
                self.peers[client] = (self.peers[client][0] + samples, now)

    def _start(self) -> None:
        now = time.monotonic()
        for _ in range(len(self.waiting)):
            if len(self.running) >= self.cfg.concurrency:
                return
            item = self.waiting.popleft()
            if item.ready_at > now:
                self.waiting.append(item)  # a requeued group waiting for its delay
                continue
            task = asyncio.ensure_future(self._score(item))
            self.running[task] = item.group
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.crash = task.exception()  # a bug in the worker itself (rewards' errors are results)

    async def _score(self, item: _Waiting) -> None:
        group = item.group
        for sample in group.samples:
            sample.reward, sample.token_rewards = None, None
            sample.reward_parts.clear()
            sample.reward_seconds.clear()
        await score_with(group, self.rewards)
        if group.scored and "greedy_text" in group.meta:  # ReMax's baseline answer
            await score_greedy_baseline(group, self.rewards)
        REWARD_SECONDS.observe(group.reward_s)
        if not group.scored and self.cfg.on_failure == "requeue" and item.requeues < self.cfg.max_requeues:
            self.requeued += len(group.samples)
            group.meta["requeues"] = item.requeues + 1
            self.waiting.append(_Waiting(group, time.monotonic() + self.cfg.requeue_delay_s, item.requeues + 1))
            return
        if not group.scored:
            self.unscored += len(group.samples)
        SAMPLES.labels("scored" if group.scored else "unscored").inc(len(group.samples))
        self.outgoing.append(group)

    def _flush(self) -> None:
        """Send finished groups to the buffer without blocking the loop; keep what it won't take yet."""
        while self.outgoing:
            try:
                self.outbox.send_frame(encode_group(self.outgoing[0]), timeout=0)
            except TimeoutError:
                now = time.monotonic()
                self.send_blocked_since = self.send_blocked_since or now
                if now - self.send_blocked_since > self.ctx.cfg.generator.send_timeout_s:
                    log.warning(
                        "%s: the buffer took no group for %.0f s; still waiting",
                        self.ctx.name,
                        now - self.send_blocked_since,
                    )
                    self.send_blocked_since = now
                return
            self.send_blocked_since = None
            self.forwarded += len(self.outgoing.popleft().samples)

    def close(self) -> None:
        self.outbox.close()
        if self.owner:
            self.inbox.close()
            if self.share is not None:
                self.share.close()
        else:
            self.client.close()


def build_rewards(cfg: RewardConfig) -> list[tuple[Reward, float]]:
    return [(build_reward(spec), spec.weight) for spec in cfg.rewards]


def run_reward_worker(ctx: RewardContext, owner: bool = True) -> None:
    """The controller's reward worker (owner of the input), or a hot-plugged one (``owner=False``)."""
    worker = RewardWorker(ctx, build_rewards(ctx.cfg.reward), owner)

    def leave(signum, _frame):
        log.info("%s: signal %d: finishing what it holds, then leaving", ctx.name, signum)
        worker.leave = True

    if not owner:
        signal.signal(signal.SIGTERM, leave)
        signal.signal(signal.SIGINT, leave)
    try:
        asyncio.run(worker.run())
    finally:
        ctx.emit("final", **worker.final_counts())
        worker.close()
