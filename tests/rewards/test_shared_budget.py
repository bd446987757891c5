"""Two reward workers, the owner of the stream and a hot-plugged one (real sockets, one event
loop), score through one local judge and share its budget: the judge never sees more requests per
minute or in flight than configured, in total; once the hot-plugged one leaves, the owner has the
whole budget again."""

import asyncio
import time
from types import SimpleNamespace

from asyncrl import wire
from asyncrl.config import RunConfig
from asyncrl.rewards.budget import RateBudgets, budget_id
from asyncrl.rewards.config import RewardSpec
from asyncrl.rewards.process import build_rewards
from asyncrl.rewards.registry import build_reward
from asyncrl.rewards.worker import RewardWorker
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.sockets import StreamReceiver, StreamSender
from tests.factories import make_group
from tests.rewards.fault_server import FaultServer

RPM, CONCURRENCY, BURST_S = 2400, 4, 0.1  # 40 requests per second, buckets of 4 requests in all
GROUPS, N = 12, 4


async def until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        await asyncio.sleep(0.01)


def test_two_workers_never_exceed_the_shared_budget_at_the_judge():
    server = FaultServer(lambda key, attempt, body: ("sleep", 0.1, 1.0))  # alone, one worker does 40/s
    options = {"url": server.url, "concurrency": CONCURRENCY, "rpm": RPM, "burst_s": BURST_S, "max_retries": 0}
    cfg = RunConfig(
        reward={
            "rewards": [{"kind": "http_json", "name": "judge", "options": options}],
            "concurrency": 2,
            "drain_s": 0.2,
        }
    )
    endpoints, stop = Endpoints.allocate(), {"now": False}
    buffer = StreamReceiver(endpoints.buffer_in, name="test.buffer")

    def worker(name: str, owner: bool) -> RewardWorker:
        ctx = SimpleNamespace(
            name=name, cfg=cfg, endpoints=endpoints, emit=lambda *a, **k: None, stop_requested=lambda: stop["now"]
        )
        budgets = RateBudgets()
        return RewardWorker(ctx, build_rewards(cfg.reward, None, budgets), owner, budgets=budgets)

    owner, peer = worker("reward-0", True), worker("reward-1", False)
    generator = StreamSender(endpoints.reward_in, name="test.generator")
    bid = budget_id(server.url, None)
    arrived = []

    async def run():
        tasks = [asyncio.ensure_future(owner.run()), asyncio.ensure_future(peer.run())]
        await until(lambda: peer.budgets.leased_at is not None, 5, "the hot-plugged worker's lease")
        assert owner.budgets.limiters[bid].share.rpm == RPM / 2 == peer.budgets.limiters[bid].share.rpm
        for i in range(GROUPS):
            generator.send_frame(wire.encode_group(make_group(f"g{i}", n=N)), timeout=5)

        def take() -> bool:
            while (msg := buffer.recv(timeout=0)) is not None:
                arrived.append(msg[1].group)
            return len(arrived) == GROUPS

        await until(take, 10, "every group in the buffer")
        peer.leave = True
        await tasks[1]
        await until(lambda: owner.budgets.limiters[bid].share.rpm == RPM, 2, "the owner's whole budget back")
        stop["now"] = True
        await tasks[0]

    try:
        asyncio.run(run())
    finally:
        for closing in (owner, peer, buffer, generator, server):
            closing.close()
    assert all(s.reward == 1.0 for g in arrived for s in g.samples)
    requests = [w.rewards[0][0].client.requests for w in (owner, peer)]
    assert min(requests) > 0 and sum(requests) == GROUPS * N, requests  # both scored: the budget was shared
    assert server.max_in_flight <= CONCURRENCY, server.max_in_flight
    # Over any window of T s the judge sees at most the buckets (rpm · burst_s / 60 = 4) + rpm · T / 60.
    arrivals = sorted(server.arrivals)
    busiest = max(sum(1 for t in arrivals if start <= t < start + 1.0) for start in arrivals)
    assert busiest <= RPM / 60 + RPM * BURST_S / 60, busiest


def test_rewards_of_one_worker_on_one_budget_share_its_slots_and_a_retry_after():
    def behaviour(key, attempt, body):
        if key == "limited/0" and attempt == 1:
            return ("status", 429, 0.5)  # the key is rate limited: every reward on it waits
        return ("sleep", 0.05, 1.0)

    server = FaultServer(behaviour)
    budgets = RateBudgets()
    options = {"url": server.url, "concurrency": 2, "max_retries": 1, "backoff_base_s": 0.01}
    judge, scorer = (
        build_reward(
            RewardSpec(kind="http_json", name=name, options={**options, "url": server.url + path}), None, budgets
        )
        for name, path in (("judge", "/a"), ("scorer", "/b"))
    )
    assert judge.client.limiter is scorer.client.limiter  # one host, no key variable: one budget

    async def run():
        await asyncio.gather(judge.score(make_group("both", n=6)), scorer.score(make_group("also", n=6)))
        limited = asyncio.ensure_future(judge.score(make_group("limited", n=1)))
        await until(lambda: server.attempts["limited/0"] == 1, 5, "the 429")
        refused_at = time.monotonic()
        await asyncio.sleep(0.05)
        await scorer.score(make_group("after", n=1))
        await limited
        return refused_at

    try:
        refused_at = asyncio.run(run())
    finally:
        server.close()
    assert server.max_in_flight <= 2, server.max_in_flight  # not 2 per reward
    after = [t for t, h in zip(server.arrivals, server.headers) if h["Idempotency-Key"] == "scorer:after/0"]
    assert after and after[0] >= refused_at + 0.4, after[0] - refused_at  # paused by the judge's 429
