"""The HTTP rewards against a real local server that injects faults: every sample ends scored or
unscored with its reason, none lost or duplicated, retries bounded, the API key sent but never shown."""

import asyncio
import logging
import time

import pytest

from asyncrl.observability.metrics import REGISTRY
from asyncrl.rewards.base import Unscored, score_with
from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward, JudgeConfig, OpenAIJudgeReward
from asyncrl.rewards.ratelimit import TokenBucket
from asyncrl.rewards.registry import RewardSpec, build_reward
from tests.factories import make_group
from tests.rewards.fault_server import FaultServer

MAX_RETRIES = 3


def faults(key: str, attempt: int, body: dict):
    """Each sample's fault is picked by its index (uid ``g/i``)."""
    i = int(key.rsplit("/", 1)[1])
    score = i / 10
    kind = i % 8
    if kind == 1 and attempt <= 2:
        return ("status", 429, 0.05)  # rate limited twice, with Retry-After
    if kind == 2 and attempt == 1:
        return ("status", 503, None)
    if kind == 3 and attempt == 1:
        return ("sleep", 6.0, score)  # well past the client's timeout
    if kind == 4:
        return ("sleep", 0.2, score)  # slow, but in time even on a loaded machine (timeout_s 2.0)
    if kind == 5:
        return ("garbage",)
    if kind == 6:
        return ("status", 500, None)  # fails for good
    if kind == 7:
        return ("status", 429, 0.01)  # rate limited for good
    return ("ok", score)


@pytest.fixture
def server():
    s = FaultServer(faults)
    yield s
    s.close()


def test_every_sample_ends_scored_or_unscored_with_its_reason(server, monkeypatch, caplog):
    monkeypatch.setenv("TEST_SCORER_KEY", "sk-secret-123")
    cfg = JsonScorerConfig(
        url=server.url,
        api_key_env="TEST_SCORER_KEY",
        timeout_s=2.0,
        max_retries=MAX_RETRIES,
        backoff_base_s=0.01,
        backoff_max_s=0.2,
        concurrency=8,
        max_score=2.0,  # scores i / 10 for i < 16
    )
    reward = JsonScorerReward("faulty", cfg)  # a name of its own: metric values are this test's
    group = make_group("g", n=16)
    caplog.set_level(logging.DEBUG)
    results = asyncio.run(_score_and_close(reward, group))

    for i, result in enumerate(results):
        kind = i % 8
        if kind in (0, 1, 2, 3, 4):
            assert result == pytest.approx(i / 10), (i, result)
        else:
            assert isinstance(result, Unscored), (i, result)
            assert result.reason == {5: "bad_json", 6: "http_5xx", 7: "http_429"}[kind]
    # Bounded retries, one key per sample, nothing lost or sent for another sample.
    assert set(server.attempts) == {s.uid for s in group.samples}
    assert max(server.attempts.values()) <= MAX_RETRIES + 1
    # A failing status and a malformed body are both retried (the idempotency key makes it safe).
    assert server.attempts["g/6"] == MAX_RETRIES + 1 and server.attempts["g/5"] == MAX_RETRIES + 1
    assert server.attempts["g/1"] == 3 and server.attempts["g/0"] == 1
    # Metrics: requests, retries and errors by kind, latency per reward.
    value = REGISTRY.get_sample_value
    assert value("asyncrl_reward_requests_total", {"reward": "faulty"}) == sum(server.attempts.values())
    assert value("asyncrl_reward_retries_total", {"reward": "faulty"}) == sum(server.attempts.values()) - 16
    # samples 1, 9: two 429s each; 7, 15: 429 on every attempt; 3, 11: one timeout each
    assert value("asyncrl_reward_errors_total", {"reward": "faulty", "kind": "http_429"}) == 2 * 2 + 2 * (
        MAX_RETRIES + 1
    )
    assert value("asyncrl_reward_errors_total", {"reward": "faulty", "kind": "timeout"}) == 2
    # The key is sent as a bearer token and shown nowhere.
    assert all(h["Authorization"] == "Bearer sk-secret-123" for h in server.headers)
    assert "sk-secret-123" not in caplog.text and "sk-secret-123" not in repr(reward.client)


async def _score_and_close(reward, group):
    try:
        return await reward.score(group)
    finally:
        await reward.close()


def test_a_group_with_a_failed_sample_is_unscored_with_the_reward_and_reason(server):
    cfg = JsonScorerConfig(url=server.url, timeout_s=0.5, max_retries=1, backoff_base_s=0.01)
    group = make_group("g", n=7)  # sample 6 fails for good
    reward = JsonScorerReward("scorer", cfg)
    asyncio.run(score_with(group, [(reward, 1.0)]))
    asyncio.run(reward.close())
    assert not group.scored and all(s.reward is None for s in group.samples)
    assert group.unscored_reason.startswith("reward_failed: scorer: ")
    assert group.samples[0].reward_parts == {"scorer": 0.0} and "scorer" in group.samples[0].reward_seconds


def test_the_judge_parses_scores_and_leaves_garbage_unscored(server):
    replies = {0: "7", 1: "Score: 10 (great)", 2: "no idea", 3: "42"}
    server.behaviour = lambda key, attempt, body: ("chat", replies[int(key.rsplit("/", 1)[1])])
    cfg = JudgeConfig(url=server.url, prompt_template="Q {prompt} A {response} R {answer}", timeout_s=2, max_retries=0)
    reward = OpenAIJudgeReward("judge", cfg)
    results = asyncio.run(_score_and_close(reward, make_group("j", n=4)))
    assert results[:2] == [0.7, 1.0]
    assert results[2] == Unscored("unparsable_score", "'no idea'")
    assert isinstance(results[3], Unscored) and results[3].reason == "score_out_of_range"


def test_the_circuit_breaker_fails_fast(server):
    server.behaviour = lambda key, attempt, body: ("status", 500, None)
    # A cooldown no stalled machine outlasts: the three calls after the failures find it open.
    cfg = JsonScorerConfig(url=server.url, max_retries=0, breaker_failures=3, breaker_cooldown_s=60, concurrency=1)
    reward = JsonScorerReward("scorer", cfg)
    results = asyncio.run(_score_and_close(reward, make_group("b", n=6)))
    assert [r.reason for r in results] == ["http_5xx"] * 3 + ["circuit_open"] * 3
    assert sum(server.attempts.values()) == 3


def test_the_token_bucket_holds_the_rate():
    async def take_all():
        bucket = TokenBucket(rate_per_min=600, capacity=2)  # 10 per second, burst of 2
        start = time.monotonic()
        for _ in range(6):
            await bucket.take(1)
        return time.monotonic() - start

    # 2 at once, then 4 at 0.1 s each. The upper bound leaves a loaded machine seconds of delay,
    # yet fails a bucket that refills at a tenth of its rate (4 s).
    assert 0.35 < asyncio.run(take_all()) < 3.5


def test_the_request_rate_limit_spaces_requests_and_each_sample_records_its_time(server):
    server.behaviour = lambda key, attempt, body: ("ok", 1.0)
    cfg = JsonScorerConfig(url=server.url, rpm=600, burst_s=0.2, max_retries=0)  # 10/s, bursts of 2
    reward = JsonScorerReward("limited", cfg)
    group = make_group("r", n=12)
    start = time.monotonic()
    asyncio.run(score_with(group, [(reward, 1.0)]))
    asyncio.run(reward.close())
    assert time.monotonic() - start > 0.95  # 2 at once, then 10 at 0.1 s each
    assert group.scored
    seconds = [s.reward_seconds["limited"] for s in group.samples]
    # Per sample, waiting for the limit included: the last waited ~1 s for it, the first not at
    # all. Compared with each other, so that slow round trips on a loaded machine cancel out.
    assert max(seconds) > 0.9 and min(seconds) < max(seconds) - 0.5


def test_a_truncated_reply_is_retried(server):
    server.behaviour = lambda key, attempt, body: ("truncated",) if attempt == 1 else ("ok", 0.5)
    cfg = JsonScorerConfig(url=server.url, max_retries=1, backoff_base_s=0.01)
    results = asyncio.run(_score_and_close(JsonScorerReward("truncated", cfg), make_group("t", n=4)))
    assert results == [0.5] * 4 and set(server.attempts.values()) == {2}


def test_a_long_retry_after_is_honoured_in_full_or_fails_the_call(server):
    waits = {"long": 0.6, "huge": 50}
    server.behaviour = lambda key, attempt, body: ("status", 429, waits[key[:4]]) if attempt == 1 else ("ok", 1.0)
    cfg = JsonScorerConfig(url=server.url, max_retries=2, backoff_max_s=0.05, max_retry_after_s=5)
    reward = JsonScorerReward("patient", cfg)

    async def long_then_huge():
        (result,) = await reward.score(make_group("long", n=1))
        start = time.monotonic()
        (refused,) = await _score_and_close(reward, make_group("huge", n=1))
        return result, refused, time.monotonic() - start

    result, refused, seconds = asyncio.run(long_then_huge())
    assert result == 1.0 and server.arrivals[1] - server.arrivals[0] >= 0.6  # not cut to backoff_max_s
    assert refused.reason == "retry_after_too_long" and "50 s" in refused.detail
    assert server.attempts["huge/0"] == 1 and seconds < 2.0  # failed at once


def test_a_retry_after_pauses_every_call_of_the_client(server):
    server.behaviour = lambda key, attempt, body: ("status", 429, 0.5) if key == "p/0" and attempt == 1 else ("ok", 1.0)
    cfg = JsonScorerConfig(url=server.url, concurrency=1, max_retries=1)
    results = asyncio.run(_score_and_close(JsonScorerReward("paused", cfg), make_group("p", n=4)))
    assert results == [1.0] * 4
    first, *rest = sorted(server.arrivals)
    assert all(t - first >= 0.5 for t in rest)  # the other samples did not rediscover the limit


def test_a_closed_client_stays_closed_and_never_exceeds_its_concurrency(server):
    server.behaviour = lambda key, attempt, body: ("sleep", 0.5, 1.0)
    cfg = JsonScorerConfig(url=server.url, concurrency=4, max_retries=3, backoff_base_s=0.01)
    reward = JsonScorerReward("closing", cfg)

    async def close_midway():
        scoring = asyncio.ensure_future(reward.score(make_group("c", n=12)))
        await asyncio.sleep(0.2)
        await reward.close()
        closed_at = time.monotonic()
        results = await scoring
        later = await reward.score(make_group("after", n=4))
        return closed_at, results, later

    closed_at, results, later = asyncio.run(close_midway())
    assert all(isinstance(r, Unscored) and r.reason == "client_closed" for r in results + later)
    assert len(server.arrivals) == 4 and max(server.arrivals) < closed_at  # nothing sent after close
    assert server.max_in_flight <= 4


def test_a_cancelled_group_leaves_no_request_running(server):
    server.behaviour = lambda key, attempt, body: ("sleep", 5.0, 1.0)
    reward = JsonScorerReward("cancelled", JsonScorerConfig(url=server.url, concurrency=8))

    async def cancel():
        scoring = asyncio.ensure_future(reward.score(make_group("x", n=6)))
        await asyncio.sleep(0.3)
        scoring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await scoring
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await reward.close()
        return others

    assert asyncio.run(cancel()) == []


@pytest.mark.parametrize(
    ("value", "what"),
    [("sk-a b", "whitespace"), ("sk-a\nb", "whitespace"), ("sk-\x01b", "a control character"), ("sk-é", "non-ASCII")],
)
def test_a_bad_api_key_fails_at_start_without_showing_it(monkeypatch, value, what):
    monkeypatch.setenv("TEST_BAD_KEY", value)
    with pytest.raises(ValueError, match=f"API key in \\$TEST_BAD_KEY has {what} at position") as error:
        JsonScorerReward("keyed", JsonScorerConfig(url="http://127.0.0.1:9", api_key_env="TEST_BAD_KEY"))
    assert value not in str(error.value) and value.strip() not in str(error.value)
    monkeypatch.setenv("TEST_BAD_KEY", " \n")
    with pytest.raises(ValueError, match="empty"):
        JsonScorerReward("keyed", JsonScorerConfig(url="http://127.0.0.1:9", api_key_env="TEST_BAD_KEY"))


def test_an_api_key_with_a_trailing_newline_is_stripped(server, monkeypatch):
    server.behaviour = lambda key, attempt, body: ("ok", 1.0)
    monkeypatch.setenv("TEST_NEWLINE_KEY", "sk-abc123\n")
    cfg = JsonScorerConfig(url=server.url, api_key_env="TEST_NEWLINE_KEY", max_retries=0)
    assert asyncio.run(_score_and_close(JsonScorerReward("newline", cfg), make_group("n", n=2))) == [1.0, 1.0]
    assert [h["Authorization"] for h in server.headers] == ["Bearer sk-abc123"] * 2


def test_scored_again_only_the_unscored_samples_are_requested(server):
    """A requeued group keeps what its HTTP rewards already scored: the second scoring asks the API
    only for the sample that failed; a rule reward scores the whole group again."""
    server.behaviour = lambda key, attempt, body: (
        ("status", 503, None) if key == "q/2" and attempt == 1 else ("ok", 0.5)
    )
    reward = JsonScorerReward("requeued", JsonScorerConfig(url=server.url, max_retries=0))
    rule = build_reward(RewardSpec(kind="format"))
    group, known = make_group("q", n=4), {}

    async def twice():
        await score_with(group, [(reward, 1.0), (rule, 1.0)], known)
        first = group.scored
        await score_with(group, [(reward, 1.0), (rule, 1.0)], known)
        await reward.close()
        return first

    assert not asyncio.run(twice()) and group.scored
    assert server.attempts == {"q/0": 1, "q/1": 1, "q/2": 2, "q/3": 1}
    assert [s.reward_parts for s in group.samples] == [{"requeued": 0.5, "format": 0.0}] * 4
    assert set(known) == {"requeued"} and sorted(known["requeued"]) == [0, 1, 2, 3]


def test_a_reply_echoing_another_request_is_rejected_counted_and_retried(server):
    """A gateway that shuffles replies: the first attempt of every odd sample gets the reply (and
    the uid) of sample 0, or echoes another request's idempotency key; the retry gets its own."""

    def shuffled(key, attempt, body):
        i = int(key.rsplit("/", 1)[1])
        if i % 2 == 1 and attempt == 1:
            if i % 4 == 1:
                return ("json", {"uid": "m/0", "score": 0.0})
            return ("json", {"idempotency_key": "mismatched:m/0", "score": 0.0})
        return ("json", {"uid": body["uid"], "idempotency_key": f"mismatched:{key}", "score": i / 10})

    server.behaviour = shuffled
    cfg = JsonScorerConfig(url=server.url, max_retries=2, backoff_base_s=0.01)
    results = asyncio.run(_score_and_close(JsonScorerReward("mismatched", cfg), make_group("m", n=8)))
    assert results == pytest.approx([i / 10 for i in range(8)])  # nobody got another sample's score
    assert [server.attempts[f"m/{i}"] for i in range(8)] == [1, 2] * 4
    assert REGISTRY.get_sample_value("asyncrl_reward_mismatched_replies_total", {"reward": "mismatched"}) == 4


def test_a_reply_for_another_request_every_time_leaves_the_sample_unscored(server):
    server.behaviour = lambda key, attempt, body: ("json", {"uid": "other", "score": 1.0})
    cfg = JsonScorerConfig(url=server.url, max_retries=1, backoff_base_s=0.01)
    (result,) = asyncio.run(_score_and_close(JsonScorerReward("always-other", cfg), make_group("o", n=1)))
    assert result.reason == "mismatched_reply" and "'other'" in result.detail
    assert server.attempts["o/0"] == 2


ERROR_BODIES = {
    0: {"error": {"type": "overloaded_error", "message": "Overloaded"}},
    1: {"error": {"type": "rate_limit_error", "message": "slow down"}},
    2: {"error": {"message": "upstream unavailable", "code": 503}},
    3: {"error": "internal server error"},
    4: {"result": "a reply of the wrong shape"},
}


@pytest.mark.parametrize("kind", ["http_json", "openai_judge"])
def test_an_error_under_status_200_is_classified_like_its_status(server, kind):
    """Errors and wrong shapes under a 200 on the first two attempts are retried like 429/5xx; an
    invalid request is unscored at once with its reason and the server's message."""

    def errors(key, attempt, body):
        i = int(key.rsplit("/", 1)[1])
        if i == 5:
            return ("json", {"error": {"type": "invalid_request_error", "message": "prompt is too long"}})
        if attempt <= 2 and i in ERROR_BODIES:
            return ("json", ERROR_BODIES[i])
        return ("chat", "7") if kind == "openai_judge" else ("ok", 0.7)

    server.behaviour = errors
    options = dict(url=server.url, max_retries=2, backoff_base_s=0.01, backoff_max_s=0.02)
    if kind == "openai_judge":
        reward = OpenAIJudgeReward(f"errors-{kind}", JudgeConfig(**options))
    else:
        reward = JsonScorerReward(f"errors-{kind}", JsonScorerConfig(**options))
    results = asyncio.run(_score_and_close(reward, make_group("e", n=7)))
    assert results[:5] == [0.7] * 5 and results[6] == 0.7
    assert results[5].reason == "http_4xx" and "prompt is too long" in results[5].detail
    assert [server.attempts[f"e/{i}"] for i in range(7)] == [3, 3, 3, 3, 3, 1, 1]
    errors_of = lambda k: REGISTRY.get_sample_value(  # noqa: E731
        "asyncrl_reward_errors_total", {"reward": f"errors-{kind}", "kind": k}
    )
    assert (errors_of("http_429"), errors_of("http_5xx"), errors_of("bad_reply")) == (2, 6, 2)


@pytest.mark.parametrize("chunked", [True, False])
def test_an_oversized_reply_is_unscored_and_memory_stays_bounded(server, chunked):
    """A 50 MB reply (streamed without a Content-Length, or announced by one) is abandoned at
    max_response_bytes: the sample is unscored with its reason, and the client's memory at its
    peak stays a few MiB (it was ~100 MB when the reply was read whole)."""
    import tracemalloc

    server.behaviour = lambda key, attempt, body: ("huge", 50_000_000, chunked) if key == "z/0" else ("ok", 0.5)
    cfg = JsonScorerConfig(url=server.url, max_retries=2, max_response_bytes=1 << 20, timeout_s=20)
    reward = JsonScorerReward("huge", cfg)
    tracemalloc.start()
    try:
        results = asyncio.run(_score_and_close(reward, make_group("z", n=2)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert results[1] == 0.5
    assert results[0].reason == "reply_too_large" and "1048576" in results[0].detail
    assert server.attempts["z/0"] == 1  # not retried: the same request would get the same reply
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_a_reply_without_a_charset_is_read_as_utf8(server):
    """A scorer that labels its JSON text/plain, without a charset, is still read (as UTF-8)."""
    server.behaviour = lambda key, attempt, body: ("plain", '{"score": 0.25, "note": "\u00e9"}')
    cfg = JsonScorerConfig(url=server.url, max_retries=0)
    assert asyncio.run(_score_and_close(JsonScorerReward("plain", cfg), make_group("p", n=2))) == [0.25, 0.25]
