"""Benchmark: HTTP reward throughput against a local server that answers after a fixed delay.

With C requests in flight and a server answering after d seconds, the ideal is C / d requests per
second. For C in (8, 32, 128) this scores ``rounds · C`` samples (groups of 8, all submitted at
once, the client's semaphore holding C in flight) through ``JsonScorerReward`` and prints one
JSON object: throughput, its ratio to C / d, and the client process's CPU seconds per request.
The server runs in a child process (a bare asyncio HTTP/1.1 server), so its CPU is not counted.

**Outage** (``--outage 10``, on by default; 0 skips it): at C = ``--outage-concurrency`` the
judge answers for ``--before`` seconds, then every request gets a 503 at once for ``--outage``
seconds, then it answers again for ``--after`` seconds. The client runs with the default retries
and breaker, once per ``breaker_cooldown_s`` of ``--cooldowns`` (10 s, the default, and 2 s):
recovery takes at most about one cooldown after the return. The load is a reward worker's: 64
groups of 8 scored at once, each group's failed samples requeued after 2 s (only they are
requested again), so the client always has more calls than slots. It reports the seconds from the
server's return to full throughput (the first one-second window, after the return, holding at
least 90 % of C / d scored samples; goal <= 5 s) and the scored samples per second over the
whole run against C / d and against C / d over the seconds the server was up.

**Shared budget** (``--shared 6``, on by default; 0 skips it): W = 1, 2 and 4 reward workers whose
judge shares one key (``asyncrl.rewards.budget``): each worker's limiter under the owner's leases,
sent through the wire's codec as the worker sends them, each worker with more calls than slots,
for ``--shared`` seconds (measured while every worker is busy) against a judge (a thread of this process, counting arrivals) answering
after d. It reports the requests per second the judge saw against ``--shared-rpm`` / 60 (the
limit; ``concurrency`` 8 lets 40/s through, so the rate binds): the ratio must be <= 1 within its
stated error, the burst the token buckets allow (``burst_s`` = 0.5 s of the rate, in total over the
workers) over the seconds measured, plus one request; after the first second (the buckets spent)
the ratio is the steady rate's. The same run with 4 workers each holding the
whole budget (as before the budgets were shared) shows what sharing prevents.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rewards.py [--delay 0.2] [--rounds 10] [--outage 10] [--cooldowns 10,2] [--shared 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


RESPONSE = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n{"score": 1.0}'
DOWN_RESPONSE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
DOWN = {"now": False}  # the server's state: SIGUSR1 takes it down, SIGUSR2 brings it back


class _DelayedScorer(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server answering every request after ``delay`` seconds: the
    benchmark measures the client, so the server should cost as little CPU as possible."""

    def __init__(self, delay: float):
        self.delay = delay
        self.buffer = b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        loop = asyncio.get_running_loop()
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            if DOWN["now"]:
                self.transport.write(DOWN_RESPONSE)  # down: refused at once, as a load balancer does
            else:
                loop.call_later(self.delay, self._answer)

    def _answer(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(RESPONSE)


def serve(port: int, delay: float) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: DOWN.update(now=True))
        loop.add_signal_handler(signal.SIGUSR2, lambda: DOWN.update(now=False))
        server = await loop.create_server(lambda: _DelayedScorer(delay), "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_level(url: str, concurrency: int, rounds: int) -> dict:
    from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward
    from tests.factories import make_group

    reward = JsonScorerReward("bench", JsonScorerConfig(url=url, concurrency=concurrency, timeout_s=30, max_retries=0))
    groups = [make_group(f"c{concurrency}-g{i}", n=8) for i in range(max(1, rounds * concurrency // 8))]
    await asyncio.gather(*(reward.score(make_group(f"warm{i}", n=8)) for i in range(max(1, concurrency // 8))))
    cpu0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(reward.score(g) for g in groups))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await reward.close()
    n = sum(len(r) for r in results)
    failed = sum(1 for r in results for x in r if not isinstance(x, float))
    return {
        "requests": n,
        "failed": failed,
        "wall_s": round(wall, 3),
        "per_s": round(n / wall, 1),
        "cpu_ms_per_request": round(1000 * cpu / n, 3),
    }


class _OutageDriver:
    """A reward worker's load on the client (``asyncrl.rewards.worker`` with ``on_failure:
    requeue``): ``lanes`` groups of 8 scored at once; a group with unscored samples waits
    ``requeue_s`` (± the worker's jitter) and is scored again (only those samples are requested again; see
    ``asyncrl.rewards.base.score_with``), at most ``max_requeues`` times, then dropped; fresh groups
    from an endless supply while fewer than ``queue_groups`` wait (the worker's bounded intake)."""

    def __init__(self, reward, lanes: int = 64, queue_groups: int = 256, requeue_s: float = 2.0, max_requeues: int = 3):
        self.reward = reward
        self.lanes = lanes
        self.queue_groups = queue_groups
        self.requeue_s = requeue_s
        self.max_requeues = max_requeues
        self.waiting: list[tuple[float, object, dict, int]] = []  # (ready at, group, known results, requeues)
        self.made = self.dropped = 0
        self.scored_at: list[float] = []  # when each sample got its score

    def _take(self):
        from tests.factories import make_group

        now = time.monotonic()
        for i, item in enumerate(self.waiting):
            if item[0] <= now:
                del self.waiting[i]
                return item
        if len(self.waiting) >= self.queue_groups:
            return None
        self.made += 1
        return 0.0, make_group(f"outage-{self.made}", n=8), {}, 0

    async def _lane(self, until: float) -> None:
        from asyncrl.rewards.base import score_with
        from asyncrl.rewards.worker import REQUEUE_JITTER

        while time.monotonic() < until:
            item = self._take()
            if item is None:
                await asyncio.sleep(0.01)  # every group waits for its requeue delay
                continue
            _ready, group, known, requeues = item
            before = sum(len(v) for v in known.values())
            await score_with(group, [(self.reward, 1.0)], known)
            now = time.monotonic()
            self.scored_at += [now] * (sum(len(v) for v in known.values()) - before)
            if group.scored:
                continue
            if requeues < self.max_requeues:
                delay = self.requeue_s * random.uniform(1 - REQUEUE_JITTER, 1 + REQUEUE_JITTER)
                self.waiting.append((now + delay, group, known, requeues + 1))
            else:
                self.dropped += len(group.samples)
            await asyncio.sleep(0)  # a group failing at once (open breaker) must not starve the loop

    async def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        await asyncio.gather(*(self._lane(until) for _ in range(self.lanes)))


async def run_outage(url: str, server: subprocess.Popen, args, cooldown: float) -> dict:
    from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward

    c, d = args.outage_concurrency, args.delay
    cfg = JsonScorerConfig(url=url, concurrency=c, breaker_cooldown_s=cooldown)
    reward = JsonScorerReward("outage", cfg)
    driver = _OutageDriver(reward)
    await asyncio.gather(*(reward.score(_warm_group(i)) for i in range(c // 8)))
    start = time.monotonic()
    scoring = asyncio.ensure_future(driver.run(args.before + args.outage + args.after))
    await asyncio.sleep(args.before)
    server.send_signal(signal.SIGUSR1)
    down = time.monotonic()
    await asyncio.sleep(args.outage)
    server.send_signal(signal.SIGUSR2)
    back = time.monotonic()
    await scoring
    end = time.monotonic()
    await reward.close()
    ideal = c / d
    times = sorted(driver.scored_at)
    recovered = next((t for t in times if t >= back and sum(1 for u in times if t <= u < t + 1.0) >= 0.9 * ideal), None)
    breaker = reward.client.breaker
    whole = len(times) / (end - start)
    return {
        "concurrency": c,
        "server_delay_s": d,
        "before_s": args.before,
        "outage_s": round(back - down, 2),
        "after_s": args.after,
        "breaker_cooldown_s": cooldown,
        "breaker_failures": cfg.breaker_failures,
        "max_retries": cfg.max_retries,
        "scored_samples": len(times),
        "scored_during_outage": sum(1 for t in times if down + d < t < back),
        "recovery_s": round(recovered - back, 2) if recovered is not None else None,
        "recovery_within_goal_5s": recovered is not None and recovered - back <= 5.0,
        "ideal_per_s": round(ideal, 1),
        "whole_run_per_s": round(whole, 1),
        "whole_run_ratio_to_ideal": round(whole / ideal, 3),
        "whole_run_ratio_to_ideal_while_up": round(whole / (ideal * (end - start - (back - down)) / (end - start)), 3),
        "after_return_per_s": round(sum(1 for t in times if t >= back) / (end - back), 1),
        "scored_each_second_from_return": [
            sum(1 for t in times if back + k <= t < back + k + 1) for k in range(int(end - back))
        ],
        "breaker_state_at_end": breaker.state,
        "requests": reward.client.requests,
        "groups_made": driver.made,
        "samples_dropped_after_requeues": driver.dropped,
    }


async def run_shared(workers: int, args, shared: bool = True) -> dict:
    """``workers`` workers' clients scoring through one judge with one budget; see the module docstring."""
    from asyncrl.rewards.budget import LeaseTable, RateBudgets
    from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward
    from asyncrl.wire.codec import decode, encode
    from tests.factories import make_group
    from tests.rewards.fault_server import FaultServer

    server = FaultServer(lambda key, attempt, body: ("sleep", args.delay, 1.0))
    cfg = JsonScorerConfig(url=server.url, concurrency=8, rpm=args.shared_rpm, burst_s=0.5, max_retries=0)
    budgets = [RateBudgets() for _ in range(workers)]
    rewards = [JsonScorerReward(f"shared-{i}", cfg, b.limiter(cfg)) for i, b in enumerate(budgets)]
    table = LeaseTable(budgets[0], timeout_s=2.0)  # worker 0 is the owner
    for peer in budgets[1:] if shared else []:
        peer.apply_fraction(0.125)  # until its first lease
    until = time.monotonic() + args.shared

    async def lease() -> None:  # as the owner does on each turn: hear every worker, lease their shares
        while shared and time.monotonic() < until:
            for i, peer in enumerate(budgets[1:], start=1):
                table.heard(bytes([i]), f"reward-{i}", peer.ids(), leaving=False)
            for who, message in table.update().items():
                budgets[who[0]].apply_lease(decode(encode(message))[1], unleased_share=0.125)
            await asyncio.sleep(0.02)

    async def lane(reward, lane_id: str) -> None:
        k = 0
        while time.monotonic() < until:
            k += 1
            await reward.score(make_group(f"{lane_id}-{k}", n=8))

    leasing = asyncio.ensure_future(lease())
    await asyncio.sleep(0.05)  # the first leases are out, as before a worker's first groups
    start = time.monotonic()
    await asyncio.gather(*(lane(r, f"w{i}l{j}") for i, r in enumerate(rewards) for j in range(4)))
    await leasing
    for r in rewards:
        await r.close()
    server.close()
    arrivals = [t for t in server.arrivals if start <= t < until]  # every lane busy: the limit binds
    seconds = until - start
    limit = args.shared_rpm / 60
    per_s = len(arrivals) / seconds
    error = 0.5 / seconds + 1 / (limit * seconds)  # the buckets' burst (burst_s of the rate in total) and one request
    return {
        "workers": workers,
        "shared": shared,
        "limit_per_s": round(limit, 2),
        "judge_per_s": round(per_s, 2),
        "ratio_to_limit": round(per_s / limit, 3),
        "stated_error": round(error, 3),
        "ratio_after_the_first_second": round(sum(t >= start + 1 for t in arrivals) / (seconds - 1) / limit, 3),
        "within_limit": per_s / limit <= 1 + error,
        "judge_max_in_flight": server.max_in_flight,
        "concurrency_limit": cfg.concurrency,
        "seconds": round(seconds, 2),
        "requests": len(arrivals),
    }


def _warm_group(i: int):
    from tests.factories import make_group

    return make_group(f"warm-outage-{i}", n=8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--levels", default="8,32,128")
    parser.add_argument("--outage", type=float, default=10.0, help="seconds the judge is down (0: no outage run)")
    parser.add_argument("--outage-concurrency", type=int, default=32)
    parser.add_argument("--before", type=float, default=5.0, help="seconds of service before the outage")
    parser.add_argument("--after", type=float, default=10.0, help="seconds of service after it")
    parser.add_argument("--cooldowns", default="10,2", help="breaker_cooldown_s of each outage run (10: the default)")
    parser.add_argument("--shared", type=float, default=6.0, help="seconds of each shared-budget run (0: none)")
    parser.add_argument("--shared-rpm", type=float, default=1200.0, help="the shared budget's requests per minute")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.delay)
        return
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--delay", str(args.delay)])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        out = {"server_delay_s": args.delay, "levels": {}}
        for c in (int(x) for x in args.levels.split(",") if x):
            level = asyncio.run(run_level(f"http://127.0.0.1:{port}/score", c, args.rounds))
            level["ideal_per_s"] = round(c / args.delay, 1)
            level["ratio_to_ideal"] = round(level["per_s"] / level["ideal_per_s"], 3)
            out["levels"][str(c)] = level
        out["all_at_least_90_percent"] = all(v["ratio_to_ideal"] >= 0.9 for v in out["levels"].values())
        if args.outage > 0:
            out["outage"] = {}
            for cooldown in (float(x) for x in args.cooldowns.split(",") if x):
                run = asyncio.run(run_outage(f"http://127.0.0.1:{port}/score", server, args, cooldown))
                out["outage"][f"cooldown_{cooldown:g}s"] = run
        if args.shared > 0:
            out["shared_budget"] = {f"workers_{w}": asyncio.run(run_shared(w, args)) for w in (1, 2, 4)}
            out["shared_budget"]["workers_4_unshared"] = asyncio.run(run_shared(4, args, shared=False))
            out["shared_budget_within_limit"] = all(
                v["within_limit"] for v in out["shared_budget"].values() if v["shared"]
            )
        print(json.dumps(out, indent=2))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
