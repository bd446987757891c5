"""An environment over HTTP plays the same episode as the one in process; what the server gets
wrong is retried where a retry can help, and otherwise ends the episode unscored with a named
kind, never a 0; the bearer key is sent and never shown; bad options are named."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from asyncrl.configbase import UserValueError
from asyncrl.generators.config import EnvironmentConfig
from asyncrl.generators.rollouts.multi_turn import run_episode
from asyncrl.generators.rollouts.render import PlainRenderer
from asyncrl.tasks.environments.guess_number import GuessNumber
from asyncrl.tasks.environments.http import HttpEnvironment, HttpEnvironmentError, close_sessions
from tests.generators.rollouts.test_multi_turn import EOS, CharTokenizer, ScriptedModel, limits
from tests.tasks.environments.http_env_server import Fault, GuessServer

FAST = {"timeout_s": 2.0, "backoff_base_s": 0.001, "backoff_max_s": 0.01}
"""Options that keep a test quick: retries barely sleep."""


def episode(turns, env, row=None, **limit):
    renderer = PlainRenderer(CharTokenizer(), "[{content}]")
    ids = [ord(c) for c in "guess:"]
    return run_episode(ScriptedModel(turns), env, renderer, row or {"answer": "7"}, ids, limits(**limit), {EOS})


def served(server: GuessServer, play):
    """``await play(url)`` against ``server``, started and stopped around it, in a fresh loop."""

    async def main():
        url = await server.start()
        try:
            return await play(url)
        finally:
            await server.stop()
            await close_sessions()

    return asyncio.run(main())


def play_over_http(server: GuessServer, turns, options=None, **limit):
    """(the episode, its environment) of the model's ``turns`` against ``server``."""
    envs = []

    async def play(url):
        envs.append(HttpEnvironment(url=url, **{**FAST, **(options or {})}))
        return await episode(turns, envs[0], **limit)

    return served(server, play), envs[0]


def routes(server: GuessServer) -> list[str]:
    return [seen.route for seen in server.requests]


@pytest.mark.parametrize("turns", [["5", "9", "7"], ["hmm", "8", "7"], ["1", "2", "3", "4"]])
def test_an_episode_over_http_is_the_in_process_game_step_for_step(turns):
    server = GuessServer(turn_cost=0.1)
    remote, env = play_over_http(server, turns)
    local = asyncio.run(episode(turns, GuessNumber(turn_cost=0.1)))
    assert remote.response_ids.tolist() == local.response_ids.tolist()
    assert np.array_equal(remote.loss_mask, local.loss_mask)
    assert (remote.env_reward, remote.finish_reason, remote.turns, remote.env_error) == (
        local.env_reward,
        local.finish_reason,
        local.turns,
        None,
    )
    steps = [seen for seen in server.requests if seen.route == "step"]
    assert routes(server) == ["reset"] + ["step"] * local.turns + ["close"]
    assert [s.body["turn"] for s in steps] == list(range(local.turns))
    assert {s.body["episode_id"] for s in server.requests} == {env.episode_id}
    assert all(s.body["protocol"] == 1 for s in server.requests)
    assert [s.headers["Idempotency-Key"] for s in steps] == [f"{env.episode_id}/step/{t}" for t in range(local.turns)]
    assert server.games == {}  # closed


def test_each_instance_is_its_own_episode():
    assert len({HttpEnvironment(url="http://127.0.0.1:1").episode_id for _ in range(100)}) == 100


def test_the_messages_reset_answers_are_kept_for_the_episode():
    async def play(url):
        env = HttpEnvironment(url=url, **FAST)
        await env.reset({"answer": "3"})
        return env.first_messages

    first = served(GuessServer(first_message="guess from 1 to 16"), play)
    assert first == [{"role": "user", "content": "guess from 1 to 16"}]


def test_transient_failures_are_retried_and_a_retried_step_is_one_step():
    server = GuessServer(turn_cost=0.1)
    server.faults = [
        Fault("status", times=2, status=500, route="reset"),
        Fault("status", times=1, status=503),
        Fault("lost_reply", times=2),  # the server applied the guess; the client never heard
    ]
    remote, env = play_over_http(server, ["5", "9", "7"], {"max_retries": 3})
    assert remote.env_error is None
    assert remote.env_reward == pytest.approx(0.8)  # 3 guesses, not 5: the lost replies were not guessed twice
    assert routes(server) == ["reset"] * 3 + ["step"] * 6 + ["close"]
    assert env.retries == 5


def test_retry_after_is_honoured():
    server = GuessServer()
    server.faults = [Fault("status", status=429, retry_after=0.3)]
    remote, env = play_over_http(server, ["7"], {"backoff_max_s": 0.001})
    steps = [seen.at for seen in server.requests if seen.route == "step"]
    assert remote.env_reward == 1.0 and len(steps) == 2
    assert steps[1] - steps[0] >= 0.3  # the backoff alone would have waited at most 1 ms


def test_a_retry_after_past_the_bound_fails_at_once():
    server = GuessServer()
    server.faults = [Fault("status", status=503, retry_after=60)]
    remote, _ = play_over_http(server, ["7"], {"max_retry_after_s": 1.0})
    assert "environment_retry_after_too_long: POST /step (turn 0): status 503 asks to wait 60 s" in remote.env_error
    assert remote.env_reward is None and routes(server).count("step") == 1


def test_a_hanging_server_ends_the_episode_unscored_with_environment_http_timeout():
    server = GuessServer()
    server.faults = [Fault("hang", times=5)]
    remote, env = play_over_http(server, ["5", "7"], {"timeout_s": 0.2, "max_retries": 1}, step_timeout_s=10.0)
    # the request's deadline ended it, each attempt, well inside the episode's step_timeout_s
    # the kind starts the episode's error: it labels the metric and the unscored reason
    assert remote.env_error.startswith(
        "environment_http_timeout: POST /step (turn 0): no reply within 0.2 s (after 2 attempts)"
    )
    assert remote.env_reward is None and remote.turns == 1
    assert routes(server) == ["reset", "step", "step", "close"] and env.retries == 1


def test_an_unreachable_server_is_a_connection_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def play():
        try:
            return await episode(["7"], HttpEnvironment(url=f"http://127.0.0.1:{port}", max_retries=1, **FAST))
        finally:
            await close_sessions()

    remote = asyncio.run(play())
    assert "environment_http_connection: POST /reset" in remote.env_error and remote.env_reward is None


@pytest.mark.parametrize("status", [404, 400, 401])
def test_a_client_error_fails_without_retrying(status):
    server = GuessServer()
    server.faults = [Fault("status", status=status, body='{"error": "no such route"}')]
    remote, env = play_over_http(server, ["7"], {"max_retries": 3})
    assert f"environment_http_4xx: POST /step (turn 0): status {status}: " in remote.env_error
    assert "no such route" in remote.env_error  # what the server said, to debug it
    assert routes(server).count("step") == 1 and env.retries == 0


@pytest.mark.parametrize("fault", ["malformed", "wrong_shape"])
def test_a_malformed_or_wrongly_shaped_reply_is_retried_then_environment_bad_reply(fault):
    server = GuessServer()
    server.faults = [Fault(fault, times=10)]
    remote, env = play_over_http(server, ["7"], {"max_retries": 2})
    assert (
        "environment_bad_reply: POST /step (turn 0): " in remote.env_error and "(after 3 attempts)" in remote.env_error
    )
    assert remote.env_reward is None and routes(server).count("step") == 3

    server = GuessServer()
    server.faults = [Fault(fault, times=1)]
    remote, env = play_over_http(server, ["7"], {"max_retries": 2})
    assert (remote.env_error, remote.env_reward, env.retries) == (None, 1.0, 1)


@pytest.mark.parametrize(
    "body, rule",
    [
        ('{"done": true, "reward": NaN}', "NaN is not JSON"),
        ('{"done": true, "reward": 1e999}', "reward (inf) must be a finite number"),
        ('{"done": true, "reward": "1"}', "reward ('1') must be a finite number"),
        ('{"done": true, "reward": true}', "reward (True) must be a finite number"),
        ('{"reward": 1.0}', "done (None) must be true or false"),
        ('{"done": 1}', "done (1) must be true or false"),
        ('{"done": false, "messages": {"role": "user"}}', "messages must be a list, not dict"),
        ('{"done": false, "messages": ["higher"]}', "messages[0] (higher) must be a map of exactly role and content"),
        (
            '{"done": false, "messages": [{"role": "assistant", "content": "x"}]}',
            "must have a role in ('user', 'tool')",
        ),
        ('{"done": false, "messages": [{"role": "user", "content": 3}]}', "a string content"),
        ('{"done": false, "tool_calls": -1}', "tool_calls (-1) must be a non-negative integer"),
        ('{"done": false, "tool_calls": 1, "tool_errors": 2}', "tool_errors (2) must be at most tool_calls (1)"),
        ('{"done": false, "info": {}}', "unknown keys ['info']"),
        ("[1, 2]", "a JSON list, not an object"),
    ],
)
def test_a_reply_of_the_wrong_shape_is_named(body, rule):
    server = GuessServer()
    server.faults = [Fault("reply", body=body)]

    async def play(url):
        env = HttpEnvironment(url=url, max_retries=0, **FAST)
        await env.reset({"answer": "7"})
        with pytest.raises(HttpEnvironmentError) as failed:
            await env.step("7")
        return failed.value

    error = served(server, play)
    assert error.kind == "environment_bad_reply" and rule in str(error), str(error)


def test_another_protocol_and_an_oversized_reply_fail_at_once():
    for fault, kind in [
        (Fault("reply", body='{"protocol": 2, "done": true}'), "environment_bad_protocol"),
        (Fault("huge"), "environment_reply_too_large"),
    ]:
        server = GuessServer()
        server.faults = [fault]
        remote, env = play_over_http(server, ["7"], {"max_retries": 3})
        assert f"{kind}: POST /step (turn 0): " in remote.env_error, remote.env_error
        assert routes(server).count("step") == 1 and env.retries == 0


def test_close_is_best_effort_and_its_failure_counted():
    server = GuessServer()
    server.faults = [Fault("status", times=5, status=500, route="close")]
    before = HttpEnvironment.close_failures.get("environment_http_5xx", 0)
    remote, _ = play_over_http(server, ["7"], {"max_retries": 3})
    assert (remote.env_error, remote.env_reward) == (None, 1.0)
    assert routes(server).count("close") == 1  # one attempt: the episode is over
    assert HttpEnvironment.close_failures["environment_http_5xx"] == before + 1


def test_the_bearer_key_is_sent_and_never_shown(monkeypatch):
    key = "sk-test-0123456789"
    monkeypatch.setenv("ASYNCRL_TEST_HTTP_ENV_KEY", f"  {key}\n")
    options = {"api_key_env": "ASYNCRL_TEST_HTTP_ENV_KEY"}
    server = GuessServer(api_key=key)
    remote, env = play_over_http(server, ["7"], options)
    assert remote.env_reward == 1.0
    assert {seen.headers["Authorization"] for seen in server.requests} == {f"Bearer {key}"}
    assert key not in repr(env) and key not in str(vars(env.options))

    # a server that echoes what it was sent in its error: the message shows the rest, not the key
    server = GuessServer(api_key=key)
    server.faults = [Fault("status", status=403, body=f'{{"error": "forbidden: Bearer {key}"}}')]
    remote, _ = play_over_http(server, ["7"], options)
    assert "environment_http_4xx" in remote.env_error and "forbidden: Bearer <key>" in remote.env_error
    assert key not in remote.env_error

    server = GuessServer(api_key="another")
    remote, _ = play_over_http(server, ["7"], options)
    assert "environment_http_4xx: POST /reset: status 401" in remote.env_error and key not in remote.env_error


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "environment variable that is not set"),
        ("   ", "is empty"),
        ("sk 0123", "has a space, control or non-ASCII character at position 2"),
    ],
)
def test_a_missing_or_unusable_key_is_named_without_showing_it(monkeypatch, value, message):
    name = f"ASYNCRL_TEST_HTTP_ENV_KEY_{abs(hash(str(value)))}"
    if value is not None:
        monkeypatch.setenv(name, value)
    with pytest.raises(UserValueError, match=message) as failed:
        HttpEnvironment(url="http://127.0.0.1:1", api_key_env=name)
    assert value is None or value.strip() == "" or value not in str(failed.value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "environment.options.url is required (the server's base URL)"),
        ({"url": "ftp://host"}, "environment.options.url ('ftp://host'): must be an http:// or https:// URL"),
        ({"url": "http://host/?a=1"}, "environment.options.url ('http://host/?a=1'): must be an http://"),
        ({"url": "http://h", "timeout_s": 0}, "environment.options.timeout_s (0): input should be greater than 0"),
        (
            {"url": "http://h", "max_retries": -1},
            "environment.options.max_retries (-1): input should be greater than or",
        ),
        ({"url": "http://h", "max_response_bytes": 10}, "environment.options.max_response_bytes (10): input should be"),
        ({"url": "http://h", "tmeout_s": 1}, "environment.options.tmeout_s is not an option (options: url, timeout_s"),
    ],
)
def test_options_are_checked_naming_the_value_and_the_rule(options, message):
    with pytest.raises(UserValueError) as failed:
        HttpEnvironment(**options)
    assert message in str(failed.value), str(failed.value)


def test_a_config_names_it_by_its_path():
    cfg = EnvironmentConfig(
        cls="asyncrl.tasks.environments.http:HttpEnvironment", options={"url": "http://127.0.0.1:8000/"}
    )
    assert HttpEnvironment.check_options(cfg.options).url == "http://127.0.0.1:8000"
