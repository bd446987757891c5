"""An environment served over HTTP/JSON: a server in any language plays the other side of an episode.

Name it in the config as ``environment.cls: asyncrl.tasks.environments.http:HttpEnvironment``
with ``environment.options: {url: http://host:port, ...}`` (``HttpEnvironmentOptions``). One
instance per episode, as for any environment; each has its own ``episode_id`` (a uuid4 hex), and
every request body carries ``"protocol": 1``. The protocol (protocol 1):

- ``POST {url}/reset`` ``{"protocol", "episode_id", "row"}`` (the dataset row: ``columns``,
  ``answer``) -> ``{"messages": [...]}``: the messages the episode starts with after the prompt,
  if any (may be empty or absent): ``reset`` returns them, and the episode opens with them
  (kept in ``first_messages`` too).
- ``POST {url}/step`` ``{"protocol", "episode_id", "turn", "text"}`` (``turn`` counts from 0) ->
  ``{"messages": [{"role": "user" | "tool", "content": str}], "reward": float, "done": bool,
  "tool_calls": int, "tool_errors": int}``; only ``done`` is required (the rest default to
  ``[]``, 0, 0, 0): a ``Step``.
- ``POST {url}/close`` ``{"protocol", "episode_id"}`` at the end, whatever happened: best effort,
  one attempt; its reply is not read, and a failure is logged and counted, never the episode's.

A reply may carry ``"protocol"``; one other than 1 fails at once (``environment_bad_protocol``).
A reply is checked strictly: a JSON object with no keys but those above, ``done`` a bool, a
finite ``reward``, counts that are non-negative integers (errors at most calls), messages a list
of ``{"role", "content"}`` maps of strings. What a server gets wrong is named, not guessed around.

Each request has a ``timeout_s`` deadline, connection included, and the headers
``Idempotency-Key: {episode_id}/{route}[/{turn}]`` (a retried step is one step to a server that
honours it) and ``Authorization: Bearer <key>`` with the key from the environment variable
``api_key_env`` (read once per process, never logged, never in an error). Its reply is read in
chunks up to ``max_response_bytes``. Retried, up to ``max_retries`` times, sleeping
``uniform(0, min(backoff_max_s, backoff_base_s · 2^attempt))`` (exponential backoff, full
jitter) or a server's ``Retry-After`` seconds in full when it sends one (one longer than
``max_retry_after_s`` fails at once: ``environment_retry_after_too_long``): a timeout
(``environment_http_timeout``), a connection error (``environment_http_connection``), 429
(``environment_http_429``), 5xx (``environment_http_5xx``), a reply that is not JSON or has the
wrong shape (``environment_bad_reply``). Other statuses fail at once (``environment_http_4xx``,
``environment_http_status``), as does a reply over the size limit (``environment_reply_too_large``).

What still fails raises ``HttpEnvironmentError``, whose message starts with its kind; the
episode loop makes it the episode's ``env_error``: unscored with the reason, counted, never a 0
(``asyncrl.generators.rollouts.multi_turn``). ``environment.step_timeout_s`` bounds each call,
retries included: past it the episode's reason is ``environment_timeout`` instead, so keep
``(max_retries + 1) · timeout_s`` plus the sleeps below it (the defaults take at most ~22 s of 30).

One aiohttp session per event loop serves every instance (an instance lives for one episode; a
session per episode would open a connection per episode): made on first use on the running loop,
closed by ``close_sessions()`` or at exit. Its pool is unbounded on purpose: an episode has at
most one request in flight, so the episodes in flight, which the generator bounds, bound it.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import logging
import math
import os
import random
import uuid
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator

from asyncrl.configbase import Config, UserValueError
from asyncrl.tasks.environments.base import EnvironmentFailure, Step

log = logging.getLogger(__name__)

PROTOCOL = 1
"""The version of the protocol in the module docstring, in every request body."""
RETRYABLE = frozenset(
    {
        "environment_http_timeout",
        "environment_http_connection",
        "environment_http_429",
        "environment_http_5xx",
        "environment_bad_reply",
    }
)
ROLES = ("user", "tool")
STEP_KEYS = frozenset({"protocol", "messages", "reward", "done", "tool_calls", "tool_errors"})
RESET_KEYS = frozenset({"protocol", "messages"})


class HttpEnvironmentOptions(Config):
    """``environment.options`` of an ``HttpEnvironment``."""

    url: str
    """The server's base URL (``http://`` or ``https://``, no query); the routes are ``{url}/reset``,
    ``{url}/step``, ``{url}/close``."""
    timeout_s: float = Field(5.0, gt=0)
    """Deadline of one request, connection included."""
    max_retries: int = Field(3, ge=0)
    """Retries after the first attempt of a reset or step, on a timeout, a connection error, 429,
    5xx or a malformed reply."""
    backoff_base_s: float = Field(0.25, gt=0)
    """First backoff ceiling; retry k sleeps uniform(0, min(backoff_max_s, backoff_base_s · 2^k))."""
    backoff_max_s: float = Field(2.0, gt=0)
    """Largest backoff sleep between retries (a server's Retry-After is honoured in full up to
    ``max_retry_after_s``)."""
    max_retry_after_s: float = Field(5.0, ge=0)
    """Longest Retry-After waited for; a server asking for longer fails the call at once
    (``environment_retry_after_too_long``)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the key sent as ``Authorization: Bearer``
    (surrounding whitespace stripped; printable ASCII without spaces); None sends none."""
    max_response_bytes: int = Field(1 << 20, ge=1024)
    """Largest reply read, in bytes; a larger one is abandoned unread (``environment_reply_too_large``,
    not retried)."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ValueError("must be an http:// or https:// URL with a host and no query, e.g. http://127.0.0.1:8000")
        return url.rstrip("/")


class HttpEnvironmentError(EnvironmentFailure):
    """A call to the environment's server that failed for good; ``kind`` labels it and starts the
    message (``environment_http_timeout: ...``)."""

    def __init__(self, kind: str, detail: str, retry_after: float | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.retry_after = kind, detail, retry_after
        self.retryable = kind in RETRYABLE


class HttpEnvironment:
    """An environment whose game runs on a server (see the module docstring); one instance per episode.

    >>> env = HttpEnvironment(url="http://127.0.0.1:8000/", timeout_s=2)
    >>> env.options.url, len(env.episode_id), env.first_messages
    ('http://127.0.0.1:8000', 32, [])
    """

    close_failures: ClassVar[dict[str, int]] = {}
    """Failed ``close`` calls in this process, by kind (logged once per kind)."""

    def __init__(self, **options: Any):
        self.options = self.check_options(options)
        self._key = _api_key(self.options.api_key_env)
        self.episode_id = uuid.uuid4().hex
        self.turn = 0
        """The next step's ``turn``: steps answered so far."""
        self.first_messages: list[dict[str, str]] = []
        """What ``/reset`` answered: messages the episode starts with after the prompt."""
        self.requests = self.retries = 0

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> HttpEnvironmentOptions:
        """The options, checked; a ``UserValueError`` names each bad key, its value and the rule."""
        try:
            return HttpEnvironmentOptions(**options)
        except ValidationError as e:
            problems = []
            for error in e.errors():
                key = ".".join(str(part) for part in error["loc"]) or "options"
                if error["type"] == "missing":
                    problems.append(f"environment.options.{key} is required (the server's base URL)")
                elif error["type"] == "extra_forbidden":
                    known = ", ".join(HttpEnvironmentOptions.model_fields)
                    problems.append(f"environment.options.{key} is not an option (options: {known})")
                else:
                    rule = error["msg"].removeprefix("Value error, ")
                    problems.append(f"environment.options.{key} ({error['input']!r}): {rule[:1].lower()}{rule[1:]}")
            raise UserValueError("; ".join(problems)) from None

    def __repr__(self) -> str:  # never show the key
        return f"HttpEnvironment(url={self.options.url!r}, episode_id={self.episode_id!r})"

    async def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        reply = await self._call("reset", {"row": row}, f"{self.episode_id}/reset", _reset_messages)
        self.first_messages = reply
        return reply

    async def step(self, text: str) -> Step:
        fields = {"turn": self.turn, "text": text}
        step = await self._call("step", fields, f"{self.episode_id}/step/{self.turn}", _step)
        self.turn += 1
        return step

    async def close(self) -> None:
        """Best effort, one attempt: the episode is over whatever the server says."""
        try:
            await self._call("close", {}, f"{self.episode_id}/close", None, retries=0)
        except HttpEnvironmentError as e:  # deliberate: counted and logged, never the episode's failure
            count = HttpEnvironment.close_failures.get(e.kind, 0)
            HttpEnvironment.close_failures[e.kind] = count + 1
            if count == 0:
                log.warning("closing an episode on the environment server failed (logged once per kind): %s", e)

    async def _call(self, route: str, fields: dict, idempotency_key: str, parse, retries: int | None = None):
        """POST ``fields`` to ``{url}/{route}``; ``parse(reply)`` of the JSON object answered,
        retried as the module docstring says. ``parse`` None: the reply is not read."""
        cfg = self.options
        retries = cfg.max_retries if retries is None else retries
        data = _encode({"protocol": PROTOCOL, "episode_id": self.episode_id, **fields}, route)
        what = f"POST /{route}" + (f" (turn {fields['turn']})" if "turn" in fields else "")
        attempt = 0
        while True:
            try:
                reply = await self._send(route, data, idempotency_key, read=parse is not None)
                return None if parse is None else _checked(parse, reply)
            except HttpEnvironmentError as e:
                if not e.retryable or attempt >= retries:
                    tries = f" (after {attempt + 1} attempts)" if attempt else ""
                    raise HttpEnvironmentError(e.kind, f"{what}: {self._redact(e.detail)}{tries}") from None
                ceiling = min(cfg.backoff_max_s, cfg.backoff_base_s * 2**attempt)
                delay = random.uniform(0, ceiling) if e.retry_after is None else e.retry_after
                attempt += 1
                self.retries += 1
                log.debug("retrying %s of episode %s in %.2f s: %s", what, self.episode_id, delay, e.kind)
                await asyncio.sleep(delay)

    async def _send(self, route: str, data: bytes, idempotency_key: str, read: bool) -> Any:
        import aiohttp

        cfg = self.options
        headers = {"Content-Type": "application/json", "Idempotency-Key": idempotency_key}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key}"
        self.requests += 1
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        try:
            async with _session().post(
                f"{cfg.url}/{route}", data=data, headers=headers, timeout=timeout, allow_redirects=False
            ) as resp:
                if resp.status == 429 or resp.status >= 500:
                    raise self._rate_or_server_error(resp.status, resp.headers.get("Retry-After"))
                if not 200 <= resp.status < 300:
                    said = (await resp.content.read(200)).decode("utf-8", "replace").strip()
                    kind = "environment_http_4xx" if 400 <= resp.status < 500 else "environment_http_status"
                    raise HttpEnvironmentError(kind, f"status {resp.status}" + (f": {said!r}" if said else ""))
                if not read:
                    return None
                body = await self._read(resp)
        except asyncio.TimeoutError:
            raise HttpEnvironmentError("environment_http_timeout", f"no reply within {cfg.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise HttpEnvironmentError("environment_http_connection", f"{type(e).__name__}: {e}") from None
        try:
            reply = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
        except ValueError as e:  # UnicodeDecodeError is one
            raise HttpEnvironmentError("environment_bad_reply", f"not JSON ({e}): {body[:80]!r}") from None
        if not isinstance(reply, dict):
            raise HttpEnvironmentError("environment_bad_reply", f"a JSON {type(reply).__name__}, not an object")
        if reply.get("protocol", PROTOCOL) != PROTOCOL:
            raise HttpEnvironmentError(
                "environment_bad_protocol", f"the server speaks protocol {reply['protocol']!r}, this client {PROTOCOL}"
            )
        return reply

    async def _read(self, resp) -> bytes:
        """The reply's bytes, read in chunks; ``environment_reply_too_large`` past ``max_response_bytes``."""
        limit = self.options.max_response_bytes
        if resp.content_length is not None and resp.content_length > limit:
            raise HttpEnvironmentError(
                "environment_reply_too_large", f"Content-Length {resp.content_length} > max_response_bytes ({limit})"
            )
        body = bytearray()
        async for chunk in resp.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > limit:  # abandoned unread, not drained
                raise HttpEnvironmentError("environment_reply_too_large", f"more than max_response_bytes ({limit})")
        return bytes(body)

    def _rate_or_server_error(self, status: int, header: str | None) -> HttpEnvironmentError:
        kind = "environment_http_429" if status == 429 else "environment_http_5xx"
        retry_after = _retry_after(header)
        if retry_after is None:
            return HttpEnvironmentError(kind, f"status {status}")
        if retry_after > self.options.max_retry_after_s:
            return HttpEnvironmentError(
                "environment_retry_after_too_long",
                f"status {status} asks to wait {retry_after:g} s, over max_retry_after_s ({self.options.max_retry_after_s:g})",
            )
        return HttpEnvironmentError(kind, f"status {status}, Retry-After {retry_after:g} s", retry_after=retry_after)

    def _redact(self, text: str) -> str:
        """``text`` without the key, should a server echo it back."""
        return text if self._key is None else text.replace(self._key, "<key>")


def _checked(parse, reply: dict):
    try:
        return parse(reply)
    except (TypeError, ValueError) as e:
        raise HttpEnvironmentError("environment_bad_reply", str(e)) from None


def _reset_messages(reply: dict) -> list[dict[str, str]]:
    _no_other_keys(reply, RESET_KEYS)
    return _messages(reply.get("messages", []))


def _step(reply: dict) -> Step:
    _no_other_keys(reply, STEP_KEYS)
    done = reply.get("done")
    if not isinstance(done, bool):
        raise ValueError(f"done ({done!r}) must be true or false")
    reward = reply.get("reward", 0.0)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"reward ({reward!r}) must be a finite number")
    calls, errors = reply.get("tool_calls", 0), reply.get("tool_errors", 0)
    for name, count in (("tool_calls", calls), ("tool_errors", errors)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name} ({count!r}) must be a non-negative integer")
    if errors > calls:
        raise ValueError(f"tool_errors ({errors}) must be at most tool_calls ({calls})")
    messages = _messages(reply.get("messages", []))
    return Step(messages=messages, reward=float(reward), done=done, tool_calls=calls, tool_errors=errors)


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, not {type(messages).__name__}")
    for index, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"messages[{index}] ({str(m)[:60]}) must be a map of exactly role and content")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise ValueError(f"messages[{index}] must have a role in {ROLES} and a string content, not {str(m)[:60]}")
    return messages


def _no_other_keys(reply: dict, allowed: frozenset[str]) -> None:
    unknown = sorted(set(reply) - allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown} (a reply has only {sorted(allowed)})")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _encode(body: dict, route: str) -> bytes:
    try:
        return json.dumps(body, default=_jsonable, allow_nan=False).encode()
    except (TypeError, ValueError) as e:  # the row's, before anything is sent: retrying would not help
        raise HttpEnvironmentError("environment_bad_request", f"POST /{route}: the body is not JSON: {e}") from None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays, as a Parquet row holds them
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON")


def _retry_after(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header given in seconds; None if absent or an HTTP date."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return max(0.0, seconds) if seconds is not None and math.isfinite(seconds) else None


@functools.cache
def _api_key(env: str | None) -> str | None:
    """The key in environment variable ``env``, read once per process; a ``UserValueError`` that
    never shows the key if it is unset, empty or not printable ASCII without spaces."""
    if env is None:
        return None
    raw = os.environ.get(env)
    if raw is None:
        raise UserValueError(f"environment.options.api_key_env ({env!r}) names an environment variable that is not set")
    key = raw.strip()
    if not key:
        raise UserValueError(f"the key in ${env} is empty (or only whitespace)")
    bad = next((i for i, char in enumerate(key) if not 33 <= ord(char) <= 126), None)
    if bad is not None:
        raise UserValueError(
            f"the key in ${env} has a space, control or non-ASCII character at position {bad}; "
            "a key must be printable ASCII without spaces (the key itself is not shown)"
        )
    return key


_sessions: dict[asyncio.AbstractEventLoop, Any] = {}
"""The aiohttp session of each event loop (a generator has one loop)."""


def _session():
    import aiohttp

    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        for finished in [other for other in _sessions if other.is_closed()]:
            del _sessions[finished]
        # limit=0: the pool is bounded by the episodes in flight (one request each at most)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        _sessions[loop] = session
    return session


async def close_sessions() -> None:
    """Close the running loop's session (the next request opens a new one)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


@atexit.register
def _close_at_exit() -> None:
    for loop, session in list(_sessions.items()):
        if not session.closed and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(session.close())
    _sessions.clear()
