"""The circuit breaker never stays open: its half-open probe gets one attempt whose outcome always
closes or re-opens it, and scoring resumes within a cooldown of an API's return after an outage."""

import asyncio
import logging
import time

import pytest

from asyncrl.observability.metrics import REGISTRY
from asyncrl.rewards.base import Unscored
from asyncrl.rewards.breaker import PASS, PROBE, CircuitBreaker
from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward
from tests.factories import make_group
from tests.rewards.fault_server import FaultServer


def transitions(reward: str, state: str) -> float:
    return (
        REGISTRY.get_sample_value("asyncrl_reward_breaker_transitions_total", {"reward": reward, "state": state}) or 0
    )


def test_the_probe_is_one_call_and_every_outcome_settles_the_breaker():
    clock = [1000.0]  # moved by hand: no real time passes between the checks
    breaker = CircuitBreaker("unit-breaker", failures=2, cooldown_s=10.0, clock=lambda: clock[0])
    breaker.failed("http_5xx")
    assert breaker.state == "closed" and breaker.admit() == PASS
    breaker.failed("http_5xx")
    assert breaker.state == "open" and breaker.admit() is None
    clock[0] += 9.9
    breaker.failed("timeout")  # a straggler from before the outage does not postpone the probe
    clock[0] += 0.1
    assert breaker.admit() == PROBE and breaker.state == "half_open"
    assert breaker.admit() is None  # one probe at a time
    breaker.probe_failed("http_5xx")  # the probe failed, or was refused or cancelled: open again
    assert breaker.state == "open" and breaker.admit() is None
    clock[0] += 10.0
    assert breaker.admit() == PROBE
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.admit() == PASS and breaker.consecutive == 0
    assert [transitions("unit-breaker", s) for s in ("open", "half_open", "closed")] == [2, 2, 1]
    recovery = REGISTRY.get_sample_value("asyncrl_reward_breaker_recovery_seconds_sum", {"reward": "unit-breaker"})
    assert recovery == pytest.approx(20.0)  # from the first opening, across the failed probe
    assert REGISTRY.get_sample_value("asyncrl_reward_breaker_state", {"reward": "unit-breaker"}) == 0


OUTAGE_S = 2.0  # long enough for several openings and failed probes
COOLDOWN_S = 0.5
REQUEST_S = 0.05


def test_scoring_resumes_within_a_cooldown_after_an_outage(caplog):
    """The API answers 503 for 2 s, then recovers: 8 lanes keep scoring (as a reward worker with
    requeues would); the first sample scored after the return comes within the breaker's cooldown
    plus one request, and scoring never stops again."""
    state = {"down_until": None}

    def outage(key, attempt, body):
        if state["down_until"] is None:
            state["down_until"] = time.monotonic() + OUTAGE_S
        if time.monotonic() < state["down_until"]:
            return ("status", 503, None)
        return ("sleep", REQUEST_S, 1.0)

    server = FaultServer(outage)
    cfg = JsonScorerConfig(
        url=server.url,
        concurrency=8,
        timeout_s=2.0,
        max_retries=2,  # retries would run the probe into a refusal: it must get one attempt only
        backoff_base_s=0.05,
        backoff_max_s=0.2,
        breaker_failures=4,
        breaker_cooldown_s=COOLDOWN_S,
    )
    reward = JsonScorerReward("outage", cfg)
    scored_at: list[float] = []

    async def lane(i: int, until: float) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            (result,) = await reward.score(make_group(f"lane{i}-{n}", n=1))
            if isinstance(result, Unscored):
                await asyncio.sleep(0.05)  # a requeue's delay: fail fast, but never spin
            else:
                scored_at.append(time.monotonic())

    async def drive():
        until = time.monotonic() + OUTAGE_S + COOLDOWN_S + 2.0
        try:
            await asyncio.gather(*(lane(i, until) for i in range(8)))
        finally:
            await reward.close()

    caplog.set_level(logging.INFO, logger="asyncrl.rewards.breaker")
    try:
        asyncio.run(drive())
    finally:
        server.close()
    back = state["down_until"]
    after = [t for t in scored_at if t >= back]
    assert not [t for t in scored_at if t < back]
    # Within the cooldown plus one request; the slack covers a loaded machine, not a missed probe.
    assert after and after[0] - back < COOLDOWN_S + REQUEST_S + 1.0, after[:1]
    assert len(after) > 50 and after[-1] > back + COOLDOWN_S + 1.5  # and it keeps going
    assert transitions("outage", "open") >= 2 and transitions("outage", "closed") == 1
    assert transitions("outage", "half_open") == transitions("outage", "open")  # each opening probed
    assert reward.client.breaker.state == "closed"
    assert "circuit breaker open after" in caplog.text and "circuit breaker closed" in caplog.text


def test_a_probe_cancelled_before_its_reply_reopens_the_breaker():
    server = FaultServer(lambda key, attempt, body: ("sleep", 5.0, 1.0))
    cfg = JsonScorerConfig(url=server.url, breaker_failures=1, breaker_cooldown_s=0.1)
    reward = JsonScorerReward("cancelled-probe", cfg)

    async def cancel_the_probe():
        reward.client.breaker.failed("http_5xx")  # open
        await asyncio.sleep(0.15)
        probing = asyncio.ensure_future(reward.score(make_group("p", n=1)))
        await asyncio.sleep(0.3)
        state_while_probing = reward.client.breaker.state
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
        await reward.close()
        return state_while_probing

    try:
        assert asyncio.run(cancel_the_probe()) == "half_open"
    finally:
        server.close()
    assert reward.client.breaker.state == "open"  # not half open for good: the next cooldown probes again


def test_calls_waiting_for_the_rate_fail_fast_when_the_breaker_opens():
    """A dead API behind a slow rate (2 requests per second, bursts of 1): the first call fails and
    opens the breaker; the five calls queued for rate tokens fail at once as circuit_open instead
    of going out one by one over the next 2.5 s."""
    server = FaultServer(lambda key, attempt, body: ("status", 500, None))
    cfg = JsonScorerConfig(
        url=server.url, rpm=120, burst_s=0.5, max_retries=0, breaker_failures=1, breaker_cooldown_s=60, concurrency=8
    )
    reward = JsonScorerReward("queued-behind-rate", cfg)

    async def score():
        start = time.monotonic()
        try:
            return await reward.score(make_group("q", n=6)), time.monotonic() - start
        finally:
            await reward.close()

    try:
        results, seconds = asyncio.run(score())
    finally:
        server.close()
    assert sorted(r.reason for r in results) == ["circuit_open"] * 5 + ["http_5xx"]
    assert sum(server.attempts.values()) == 1  # nothing queued went out to the dead API
    assert seconds < 0.45  # the next token was 0.5 s away: nobody waited for it
    assert not reward.client._waiting
