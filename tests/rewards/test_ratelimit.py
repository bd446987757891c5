"""The HTTP client's rate limits hold against a real local server: no burst after a stall, large
requests charged in full, and calls on an open breaker refused without waiting for the rate."""

import asyncio
import time

from asyncrl.rewards.base import Unscored
from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward
from asyncrl.rewards.ratelimit import TokenBucket
from tests.factories import make_group
from tests.rewards.fault_server import FaultServer

RATE_PER_S = 10


def test_no_burst_after_a_server_freeze():
    """The server freezes for 2 s with 8 requests in flight; calls waiting meanwhile take no rate
    tokens (they wait for a slot first), so afterwards no one-second window holds more than the
    rate plus one request."""
    freeze = {"until": None}

    def frozen(key, attempt, body):
        if freeze["until"] is None:
            freeze["until"] = time.monotonic() + 2.0
        return ("sleep", max(0.0, freeze["until"] - time.monotonic()) + 0.01, 1.0)

    server = FaultServer(frozen)
    # rpm 600 = 10 per second; burst_s 0.1: a bucket of one request.
    cfg = JsonScorerConfig(url=server.url, concurrency=8, rpm=60 * RATE_PER_S, burst_s=0.1, max_retries=0)
    reward = JsonScorerReward("frozen", cfg)
    try:
        results = asyncio.run(_score_and_close(reward, make_group("f", n=36)))
    finally:
        server.close()
    assert all(r == 1.0 for r in results)
    arrivals = sorted(server.arrivals)
    busiest = max(sum(1 for t in arrivals if start <= t < start + 1.0) for start in arrivals)
    assert busiest <= RATE_PER_S + 1, busiest
    assert len(arrivals) == 36 and arrivals[-1] > freeze["until"] + 2.0  # paced after the freeze too


def test_a_request_larger_than_the_bucket_is_charged_in_full():
    async def waits():
        bucket = TokenBucket(rate_per_min=6000, capacity=10)  # 100 tokens per second, bursts of 10
        start = time.monotonic()
        await bucket.take(50)  # goes at once, alone, and leaves a debt of 40
        first = time.monotonic() - start
        await bucket.take(1)  # waits for the debt to be paid: (40 + 1) / 100 s
        return first, time.monotonic() - start

    first, second = asyncio.run(waits())
    assert first < 0.05 and 0.38 < second < 3.0


def test_the_json_scorer_is_held_to_its_token_limit():
    """Bodies of ~500 estimated tokens (bytes / 4) against 1,000 tokens per second in buckets of
    100: each request is charged in full (the bucket goes into debt), so each after the first
    waits until its ~500 tokens are paid back: 4 of them take at least 3 · 500 / 1,000 s."""
    server = FaultServer(lambda key, attempt, body: ("ok", 1.0))
    cfg = JsonScorerConfig(url=server.url, tpm=60_000, burst_s=0.1, max_retries=0)
    reward = JsonScorerReward("tokens", cfg)
    group = make_group("t", n=4)
    for sample in group.samples:
        sample.text = "x" * 2000
    start = time.monotonic()
    try:
        results = asyncio.run(_score_and_close(reward, group))
    finally:
        server.close()
    assert results == [1.0] * 4
    assert time.monotonic() - start > 3 * (2000 / 4) / 1000


def test_calls_on_an_open_breaker_fail_at_once_not_paced_by_the_rate():
    server = FaultServer(lambda key, attempt, body: ("status", 500, None))
    # One request per second, and a breaker that opens on the first failed call.
    cfg = JsonScorerConfig(url=server.url, rpm=60, burst_s=1, max_retries=0, breaker_failures=1, breaker_cooldown_s=60)
    reward = JsonScorerReward("fast-fail", cfg)

    async def fail_then_refuse():
        (first,) = await reward.score(make_group("first", n=1))
        start = time.monotonic()
        rest = await reward.score(make_group("rest", n=10))
        await reward.close()
        return first, rest, time.monotonic() - start

    try:
        first, rest, seconds = asyncio.run(fail_then_refuse())
    finally:
        server.close()
    assert first.reason == "http_5xx"
    assert all(isinstance(r, Unscored) and r.reason == "circuit_open" for r in rest)
    assert seconds < 0.5 and sum(server.attempts.values()) == 1  # paced, 10 calls would take 10 s


async def _score_and_close(reward, group):
    try:
        return await reward.score(group)
    finally:
        await reward.close()
