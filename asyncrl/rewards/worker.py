"""The reward worker's loop: take groups in, score up to ``reward.concurrency`` at once, forward them.

Shared by the owner of the input and hot-plugged workers; ``_intake`` is what differs (see
``asyncrl.rewards.process`` for how workers share the stream, and ``asyncrl.rewards.channels`` for
what each boundary blocks and drops).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

from asyncrl.observability.metrics import REWARD_QUEUE_DEPTH, REWARD_SECONDS, SAMPLES
from asyncrl.rewards.base import Known, Reward, score_greedy_baseline, score_with
from asyncrl.rewards.budget import LeaseTable, RateBudgets
from asyncrl.rewards.channels import BufferOutbox, GroupInbox, PeerShare, ShareClient
from asyncrl.rewards.config import RewardConfig
from asyncrl.rewards.context import RewardContext
from asyncrl.wire.messages import RateLease, ReadyEvent, RewardFinal, Run, WantGroups, WantRun
from asyncrl.wire.schema import Group

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.1
"""Seconds between a busy or leaving hot-plugged worker's reports of what it holds."""

REQUEUE_JITTER = 0.5
"""A requeued group waits ``requeue_delay_s`` × uniform(1 - j, 1 + j): groups that failed together
(an API outage) come back spread out, not in one wave, so the circuit breaker's probe goes as soon
as its cooldown ends and the slots refill as soon as the API is back."""


@dataclass
class _Waiting:
    group: Group
    ready_at: float = 0.0
    requeues: int = 0
    known: Known = field(default_factory=dict)
    """Results of earlier scorings (requeue): per-sample rewards re-request only what failed."""


class RewardWorker:
    """The loop shared by the owner and hot-plugged workers; ``intake`` is what differs."""

    def __init__(
        self,
        ctx: RewardContext,
        rewards: list[tuple[Reward, float]],
        owner: bool,
        by_task: dict[str, list[tuple[Reward, float]]] | None = None,
        budgets: RateBudgets | None = None,
    ):
        self.ctx = ctx
        self.cfg: RewardConfig = ctx.cfg.reward
        self.rewards = rewards
        self.by_task = by_task or {}
        """A task's own rewards (``reward.by_task``): its groups are scored by them, not ``rewards``."""
        self.owner = owner
        self.budgets = budgets if budgets is not None else RateBudgets()
        """The rate budgets the HTTP rewards draw on (``asyncrl.rewards.budget``): the owner divides them
        among the live workers, the others run under its leases."""
        self.outbox = BufferOutbox(ctx.endpoints.buffer_in, name=f"{ctx.name}.out")
        self.waiting: deque[_Waiting] = deque()
        self.running: dict[asyncio.Task, Group] = {}
        self.outgoing: deque[Group] = deque()
        self.taken = self.handed_out = self.forwarded = self.requeued = self.unscored = 0
        self.leave = False
        self.crash: BaseException | None = None
        self.last_input = time.monotonic()
        self.send_blocked_since: float | None = None
        if owner:
            self.inbox = GroupInbox(ctx.endpoints.reward_in)
            self.share = PeerShare(ctx.endpoints.reward_share) if ctx.endpoints.reward_share else None
            self.leases = LeaseTable(self.budgets, self.cfg.lease_timeout_s)
        else:
            if not ctx.endpoints.reward_share:
                raise ValueError(
                    "this run's endpoints.json has no reward_share address: its reward worker cannot share"
                )
            self.client = ShareClient(ctx.endpoints.reward_share, name=f"{ctx.name}.share")
            self.asked_at: float | None = None  # a request for work is outstanding since then
            self.heartbeat_at = 0.0
            self.budgets.apply_fraction(self.cfg.unleased_share)  # until the owner's first lease
        self.peers: dict[bytes, tuple[int, float]] = {}  # owner: peer -> (samples it holds, last heard)

    # -- counts ---------------------------------------------------------------------------------

    def held(self) -> int:
        groups = [w.group for w in self.waiting] + list(self.outgoing)
        return sum(len(g.samples) for g in groups) + sum(len(g.samples) for g in self.running.values())

    def final_report(self) -> RewardFinal:
        return RewardFinal(
            received=self.taken - self.handed_out,
            forwarded=self.forwarded,
            held=self.held(),
            handed_out=self.handed_out,
            requeued=self.requeued,
            unscored=self.unscored,
            rejected_frames=self.inbox.rejected if self.owner else self.client.rejected,
        )

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        self.ctx.emit(ReadyEvent())
        while True:
            if self.crash is not None:
                raise self.crash
            stopping = self.ctx.stop_requested() or self.leave
            self._flush()
            if not self.outgoing:
                self._intake(stopping)
            self._start()
            self._report_depths()
            if stopping and self._drained():
                break
            await self._wait()
        if not self.owner:
            self._ask(0, leaving=True)  # the owner forgets this worker; its empty reply is not needed
        for rewards in [self.rewards, *self.by_task.values()]:
            for reward, _w in rewards:
                await reward.close()

    def _report_depths(self) -> None:
        REWARD_QUEUE_DEPTH.labels("waiting").set(len(self.waiting))
        REWARD_QUEUE_DEPTH.labels("scoring").set(len(self.running))
        REWARD_QUEUE_DEPTH.labels("to_buffer").set(len(self.outgoing))

    async def _wait(self) -> None:
        """Until a group finishes scoring, or 5 ms (the sockets are polled, not awaited)."""
        if self.running:
            await asyncio.wait(list(self.running), timeout=0.005, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(0.005)

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
            while self._room() > 0:
                arrived, group = self.inbox.receive()
                if not arrived:
                    break
                self.last_input = time.monotonic()
                if group is not None:
                    self._take(group)
            if self.share is not None:
                self._serve_peers()
            return
        # A hot-plugged worker: collect any reply, then ask for as many groups as it has free slots,
        # or (full, or leaving) ask for none: a heartbeat that tells the owner what it still holds.
        for reply in self.client.replies():
            if isinstance(reply, RateLease):
                self.budgets.apply_lease(reply, self.cfg.unleased_share)
                continue
            self.asked_at = None
            for group in reply:
                self._take(group)
        self.budgets.expire(self.cfg.lease_timeout_s, self.cfg.unleased_share)
        now = time.monotonic()
        free = 0 if stopping else self.cfg.concurrency - len(self.running) - len(self.waiting)
        overdue = self.asked_at is not None and now - self.asked_at > self.cfg.request_timeout_s
        if (self.asked_at is None or overdue) and (free > 0 or now - self.heartbeat_at > HEARTBEAT_S):
            self._ask(free)

    def _ask(self, max_groups: int, leaving: bool = False) -> None:
        request = WantGroups(
            max_groups=max_groups,
            holding=self.held(),
            leaving=leaving,
            worker=self.ctx.name,
            budgets=self.budgets.ids(),
        )
        if not self.client.ask(request):  # the owner is not there (yet): ask again on a later turn
            return
        self.asked_at = self.heartbeat_at = time.monotonic()

    def _take(self, group: Group) -> None:
        self.taken += len(group.samples)
        self.waiting.append(_Waiting(group))

    def _serve_peers(self) -> None:
        asks = []
        for client, request in self.share.requests():
            if isinstance(request, WantRun):  # a worker joining by address learns the run from us
                run = Run(config=self.ctx.cfg.model_dump(mode="json"), endpoints=self.ctx.endpoints.model_dump())
                self.share.tell_run(client, run, request.request_id)
                continue
            if not isinstance(request, WantGroups):
                continue
            self.peers[client] = (request.holding, time.monotonic())
            if request.leaving:
                self.peers.pop(client)
            self.leases.heard(client, request.worker, request.budgets, request.leaving)
            asks.append((client, request))
        # Every request of this turn read, the budgets are divided again (a join, a leave, a death)
        # and the leases go out before any group: a worker never scores outside its share.
        for client, lease in self.leases.update().items():
            if not self.share.lease(client, lease):
                self.leases.unsent(client)
        for client, request in asks:
            self._give(client, request)

    def _give(self, client: bytes, request: WantGroups) -> None:
        """Reply to a request for work with up to ``max_groups`` groups ready to be scored (possibly none)."""
        now = time.monotonic()
        given = []
        while self.waiting and len(given) < request.max_groups and self.waiting[0].ready_at <= now:
            given.append(self.waiting.popleft())
        if not self.share.give(client, [w.group for w in given]):  # the peer is gone or full: keep its groups
            self.waiting.extendleft(reversed(given))
            return
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
        rewards = self.by_task.get(group.task, self.rewards)
        await score_with(group, rewards, item.known)
        if group.scored and group.greedy_text is not None:  # ReMax's baseline answer
            await score_greedy_baseline(group, rewards)
        REWARD_SECONDS.observe(group.reward_s)
        if not group.scored and self.cfg.on_failure == "requeue" and item.requeues < self.cfg.max_requeues:
            self.requeued += len(group.samples)
            group.meta["requeues"] = item.requeues + 1
            delay = self.cfg.requeue_delay_s * random.uniform(1 - REQUEUE_JITTER, 1 + REQUEUE_JITTER)
            ready_at = time.monotonic() + delay
            self.waiting.append(_Waiting(group, ready_at, item.requeues + 1, item.known))
            return
        if not group.scored:
            self.unscored += len(group.samples)
        SAMPLES.labels("scored" if group.scored else "unscored").inc(len(group.samples))
        self.outgoing.append(group)

    def _flush(self) -> None:
        """Send finished groups to the buffer without blocking the loop; keep what it won't take yet."""
        while self.outgoing:
            if not self.outbox.offer(self.outgoing[0]):
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
