"""The gateway: an OpenAI-compatible HTTP server through which an agent program's model calls are
sampled by the generator's engine, episode by episode.

Each open episode has its own base URL and its own bearer token::

    http://HOST:PORT/episodes/<episode_id>/v1      POST /chat/completions, POST /completions, GET /models
    http://HOST:PORT/episodes/<episode_id>/reward  POST {"reward": float}: the episode ends

so any client of the OpenAI API works with ``base_url`` and ``api_key`` set. The server runs on
the engine's event loop (``start``/``close`` are coroutines for it): a call is one engine request,
batched by vLLM with every other request in flight.

Refusals are OpenAI-shaped, ``{"error": {"message", "type"}}``, and name the rule: an unknown
episode 404, a bad token 401, an episode already over 409, a body past ``max_request_bytes`` 413,
and 400 for what the gateway cannot honour without changing what it trains on (``n`` > 1,
``stream``, tools, a response format, ``best_of``, ``echo``). Every refusal carries
``x-should-retry: false``: the OpenAI clients would otherwise retry a 409 by themselves. Sampling
settings a request asks for are ignored (``asyncrl.generators.gateway.session`` says why).

Binding to 127.0.0.1 (the default) keeps the gateway to programs on the generator's machine; the
per-episode token keeps one episode's program off another's episode. Every wait is bounded: the
body read by ``READ_TIMEOUT_S``, a call by its episode's end (``agent.episode_timeout_s``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections import OrderedDict

from aiohttp import web

from asyncrl.generators.gateway.session import AgentEpisode, GatewayError

READ_TIMEOUT_S = 30.0
"""Seconds a request body may take to arrive."""
CLOSED_KEPT = 4096
"""Ended episodes remembered (their token), so that a late call gets 409 rather than 404."""
UNSUPPORTED = {
    "stream": "streaming is not supported: send stream false and read the whole reply",
    "tools": "tool definitions are not supported: describe the tools in the messages and parse the reply",
    "functions": "function definitions are not supported: describe them in the messages and parse the reply",
    "response_format": "a response format would constrain the sampling, which the learner's ratio does not know",
    "echo": "echo is not supported",
    "suffix": "suffix (insertion) is not supported",
}
"""Request fields refused (400) when set to anything but their neutral value, and why."""


def _error(status: int, message: str, type_: str) -> web.Response:
    body = {"error": {"message": message, "type": type_, "code": None}}
    return web.json_response(body, status=status, headers={"x-should-retry": "false"})


class Gateway:
    """The HTTP server (see the module docstring); ``port`` 0 binds a free port, read back as
    ``self.port`` once started."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_request_bytes: int = 4 << 20, model="policy"):
        self.host, self.port, self.max_request_bytes, self.model = host, port, max_request_bytes, model
        self.episodes: dict[str, AgentEpisode] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{episode}/v1/completions", self._complete)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_post("/episodes/{episode}/reward", self._reward)
        # handler_cancellation: a client that hangs up cancels its call (its engine request is aborted).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        for episode_id in list(self.episodes):
            await self.end(episode_id)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode: AgentEpisode) -> str:
        """Serve ``episode`` under a new id; returns the id."""
        episode_id = secrets.token_hex(8)
        self.episodes[episode_id] = episode
        return episode_id

    async def end(self, episode_id: str) -> None:
        """Stop serving an episode: later calls get 409, calls in flight are cancelled."""
        episode = self.episodes.pop(episode_id, None)
        if episode is None:
            return
        self._closed[episode_id] = episode.token
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)
        await episode.close()

    def base_url(self, episode_id: str) -> str:
        return f"{self._origin()}/episodes/{episode_id}/v1"

    def reward_url(self, episode_id: str) -> str:
        return f"{self._origin()}/episodes/{episode_id}/reward"

    def _origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"http://{host}:{self.port}"

    def _episode(self, request: web.Request) -> AgentEpisode:
        """The request's open episode, or the refusal: 404 unknown, 401 bad token, 409 over."""
        episode_id = request.match_info["episode"]
        header = request.headers.get("Authorization")
        episode = self.episodes.get(episode_id)
        if episode is None and episode_id not in self._closed:
            raise GatewayError(404, f"no episode {episode_id!r}: use the base URL the episode was given", "not_found")
        token = episode.token if episode is not None else self._closed[episode_id]
        if header is None or not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
            raise GatewayError(
                401, "missing or wrong bearer token: send the episode's OPENAI_API_KEY", "authentication_error"
            )
        if episode is None or episode.closed:
            raise GatewayError(409, f"episode {episode_id} is over: no call is taken after its reward or its end")
        return episode

    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), READ_TIMEOUT_S)
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(
                413, f"the request body exceeds {self.max_request_bytes} bytes (agent.max_request_bytes)"
            ) from None
        except asyncio.TimeoutError:
            raise GatewayError(408, f"the request body took longer than {READ_TIMEOUT_S:g} s to arrive") from None
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise GatewayError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise GatewayError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def _call(self, request: web.Request, chat: bool) -> web.Response:
        try:
            episode = self._episode(request)
            body = await self._body(request)
            for key in ("n", "best_of"):
                if body.get(key) not in (None, 1):
                    raise GatewayError(400, f"{key} ({body[key]!r}) must be 1: make one call per sample")
            for key, why in UNSUPPORTED.items():
                value = body.get(key)
                if value not in (None, False, [], "") and not (key == "response_format" and _text_format(value)):
                    raise GatewayError(400, f"{key} ({json.dumps(value)[:60]}) is refused: {why}")
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
            if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
                raise GatewayError(400, f"max_tokens ({max_tokens!r}) must be an integer")
            if max_tokens is not None and max_tokens < 1:
                raise GatewayError(400, f"max_tokens ({max_tokens}) must be >= 1")
            stop = _stop(body.get("stop"))
            episode.note_ignored(body)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise GatewayError(400, "messages must be a non-empty list")
                turn, prompt_tokens = await episode.chat(messages, max_tokens, stop)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
                if not isinstance(prompt, str):
                    raise GatewayError(400, "prompt must be one string")
                turn, prompt_tokens = await episode.complete(prompt, max_tokens, stop)
        except GatewayError as e:
            return _error(e.status, str(e), e.type)
        finish = "length" if turn.finish_reason == "length" else "stop"
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": turn.text}
        else:
            choice["text"] = turn.text
        completion_tokens = len(turn.response_ids)
        return web.json_response(
            {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(8)}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._call(request, chat=True)

    async def _complete(self, request: web.Request) -> web.Response:
        return await self._call(request, chat=False)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except GatewayError as e:
            return _error(e.status, str(e), e.type)
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "asyncrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            episode = self._episode(request)
            body = await self._body(request)
            episode.post_reward(body.get("reward"))
        except GatewayError as e:
            return _error(e.status, str(e), e.type)
        return web.json_response({"ok": True})


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops) or len(stops) > 4:
        raise GatewayError(400, f"stop ({value!r:.60}) must be a non-empty string or a list of up to 4 of them")
    return stops


def _text_format(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"
