"""The gateway answers in OpenAI's shape, samples with the run's settings whatever a request asks,
and refuses what it must with an OpenAI-style error naming the rule: unknown episode 404, bad token
401, an episode over 409, n > 1 / stream / tools 400, a body too large 413."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from asyncrl.generators.gateway.recorder import EpisodeRecorder
from asyncrl.generators.gateway.server import Gateway
from asyncrl.generators.gateway.session import AgentEpisode
from asyncrl.generators.rollouts.render import ChatRenderer
from asyncrl.generators.sampling import SamplingConfig
from tests.generators.gateway.conftest import fake_params

SAMPLING = SamplingConfig(n=1, temperature=0.9, top_p=0.95, max_tokens=8)


def open_episode(gateway: Gateway, engine, max_calls: int = 4, max_model_len: int = 256) -> tuple[str, AgentEpisode]:
    tok = engine.tokenizer
    recorder = EpisodeRecorder(tok, ChatRenderer(tok), {tok.eos_token_id})
    episode = AgentEpisode("g/0", engine, recorder, SAMPLING, max_model_len, max_calls, 11, 0, fake_params)
    return gateway.open(episode), episode


def serve(check, max_request_bytes: int = 4096):
    """Run ``check(gateway, http)`` against a started gateway on 127.0.0.1, then close it."""

    async def main():
        gateway = Gateway("127.0.0.1", 0, max_request_bytes)
        await gateway.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                return await check(gateway, http)
        finally:
            await gateway.close()

    return asyncio.run(main())


async def call(http, url, token, body=None, method="POST"):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with http.request(method, url, json=body, headers=headers) as response:
        return response.status, await response.json(), response.headers


def test_a_chat_call_is_sampled_with_the_runs_settings_and_answered_in_openai_shape(engine):
    async def check(gateway, http):
        episode_id, episode = open_episode(gateway, engine)
        url = gateway.base_url(episode_id)
        assert url.startswith("http://127.0.0.1:") and gateway.port > 0
        body = {"messages": [{"role": "user", "content": "What is 2+3?"}], "temperature": 0.1, "max_tokens": 100}
        status, reply, _ = await call(http, url + "/chat/completions", episode.token, body)
        assert status == 200, reply
        choice = reply["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "5"} and choice["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == 2  # "5" + EOS
        assert reply["usage"]["prompt_tokens"] == len(engine.requests[0][0])
        (_, params) = engine.requests[0]
        assert params.temperature == 0.9 and params.top_p == 0.95  # the run's, not the request's 0.1
        assert params.max_tokens == 8  # min(request 100, sampling.max_tokens 8, room)
        assert episode.ignored == {"temperature"}
        status, reply, _ = await call(
            http, url + "/completions", episode.token, {"prompt": "What is 1+1?", "max_tokens": 1}
        )
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
        assert engine.requests[1][1].max_tokens == 1
        status, models, _ = await call(http, url + "/models", episode.token, method="GET")
        assert status == 200 and models["data"][0]["id"] == "policy"

    serve(check)


def test_refusals_name_the_rule_in_openai_shape(engine):
    async def check(gateway, http):
        episode_id, episode = open_episode(gateway, engine, max_calls=1, max_model_len=64)
        url = gateway.base_url(episode_id)
        chat = url + "/chat/completions"
        ok = {"messages": [{"role": "user", "content": "hi"}]}
        cases = [
            (gateway.base_url("0123456789abcdef") + "/chat/completions", episode.token, ok, 404, "no episode"),
            (chat, "wrong", ok, 401, "bearer token"),
            (chat, None, ok, 401, "bearer token"),
            (chat, episode.token, {**ok, "n": 2}, 400, "n (2) must be 1"),
            (chat, episode.token, {**ok, "stream": True}, 400, "stream"),
            (chat, episode.token, {**ok, "tools": [{"type": "function"}]}, 400, "tools"),
            (chat, episode.token, {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "max_request_bytes"),
            (chat, episode.token, {"messages": [{"role": "user", "content": "x" * 60}]}, 400, "max_model_len"),
        ]
        for target, token, body, status, words in cases:
            got, reply, headers = await call(http, target, token, body)
            assert got == status, (body, reply)
            assert words in reply["error"]["message"] and reply["error"]["type"]
            assert headers["x-should-retry"] == "false"
        assert engine.requests == []  # nothing refused reached the engine
        assert (await call(http, chat, episode.token, ok))[0] == 200
        got, reply, _ = await call(http, chat, episode.token, ok)
        assert got == 400 and "agent.max_calls" in reply["error"]["message"]
        reward = gateway.reward_url(episode_id)
        assert (await call(http, reward, episode.token, {"reward": "high"}))[0] == 400
        assert (await call(http, reward, episode.token, {"reward": 1.0}))[:2] == (200, {"ok": True})
        assert episode.reward == 1.0 and episode.rewarded.is_set()
        for target, body in ((chat, ok), (reward, {"reward": 0.0})):
            got, reply, _ = await call(http, target, episode.token, body)
            assert got == 409 and "is over" in reply["error"]["message"]
        await gateway.end(episode_id)  # ended and forgotten by the gateway: still 409, not 404
        assert (await call(http, chat, episode.token, ok))[0] == 409
        assert (await call(http, chat, "wrong", ok))[0] == 401

    serve(check)


def test_an_episode_ended_mid_call_cancels_the_call_and_records_nothing(engine):
    started = asyncio.Event()

    class SlowEngine:
        tokenizer = engine.tokenizer

        async def sample_request(self, prompt_ids, params, request_id):
            started.set()
            await asyncio.sleep(60)

    async def check(gateway, http):
        episode_id, episode = open_episode(gateway, SlowEngine())
        body = {"messages": [{"role": "user", "content": "hi"}]}
        pending = asyncio.ensure_future(
            call(http, gateway.base_url(episode_id) + "/chat/completions", episode.token, body)
        )
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.wait_for(gateway.end(episode_id), 10)
        status, reply, _ = await asyncio.wait_for(pending, 10)
        assert status == 409, reply
        assert episode.recorder.parts == []

    serve(check)


def test_a_request_body_that_is_not_an_object_is_refused(engine):
    async def check(gateway, http):
        episode_id, episode = open_episode(gateway, engine)
        headers = {"Authorization": f"Bearer {episode.token}"}
        url = gateway.base_url(episode_id) + "/completions"
        for data in (b"not json", json.dumps([1, 2]).encode(), json.dumps({"prompt": 3}).encode()):
            async with http.post(url, data=data, headers=headers) as response:
                assert response.status == 400 and "error" in await response.json()

    serve(check)


def test_the_openai_client_works_unchanged_and_does_not_retry_a_refusal(engine):
    openai = pytest.importorskip("openai")  # vLLM's dependency: the client most agents are written with
    httpx = pytest.importorskip("httpx")

    async def check(gateway, http):
        episode_id, episode = open_episode(gateway, engine)
        sent = []

        async def count(request):
            sent.append(request.url.path)

        client = openai.AsyncOpenAI(
            base_url=gateway.base_url(episode_id),
            api_key=episode.token,
            max_retries=2,
            http_client=httpx.AsyncClient(event_hooks={"request": [count]}),
        )
        try:
            reply = await client.chat.completions.create(
                model="anything", messages=[{"role": "user", "content": "What is 2+3?"}], max_tokens=4
            )
            assert reply.choices[0].message.content == "5" and reply.usage.completion_tokens == 2
            text = await client.completions.create(model="anything", prompt="What is 1+2?")
            assert text.choices[0].text == "3"
            assert [m.id async for m in client.models.list()] == ["policy"]
            with pytest.raises(openai.BadRequestError, match="n \\(2\\) must be 1"):
                await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], n=2)
            episode.post_reward(1.0)
            before = len(sent)
            with pytest.raises(openai.ConflictError, match="is over"):
                await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
            assert len(sent) == before + 1  # x-should-retry: false; a 409 is retried otherwise
            bad = openai.AsyncOpenAI(base_url=gateway.base_url(episode_id), api_key="wrong")
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
        finally:
            await client.close()

    serve(check)
