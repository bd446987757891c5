"""An async HTTP client for rewards behind an API: limits, timeouts, retries, a circuit breaker.

One ``HttpClient`` per reward. An attempt of a call (``post_json``) goes through, in order:

1. the circuit breaker (``asyncrl.rewards.breaker``): open, the attempt fails at once
   (``circuit_open``, not retried) without waiting for anything below; half open, exactly one
   call gets one attempt (the probe) and its outcome closes or re-opens the breaker;
2. one of this worker's share of the ``concurrency`` slots (the breaker is checked again once it has one, so calls queued
   behind failing ones fail fast too, and a call waiting in 3 or 4 below fails as ``circuit_open``
   the moment the breaker opens: nothing queued goes out to an API found dead meanwhile);
3. a pause every call of the client observes after a server's ``Retry-After`` (a rate limit
   backs off once for the client, not rediscovered sample by sample), and every call of the
   process's other rewards on the same budget (the same key at the same host);
4. the ``rpm`` and ``tpm`` token buckets (``asyncrl.rewards.ratelimit``, at this worker's share), taken last, while
   holding the slot: a call never holds tokens while it waits for anything else, so tokens are
   not hoarded during a stall and spent in a burst after it. ``tpm`` charges a call its full
   token count (the bucket may go into debt); the judge estimates prompt characters / 4 +
   ``max_tokens``, other calls the request body's bytes / 4 (the reply is not counted);
5. the request, with a ``timeout_s`` deadline, its reply read in chunks up to
   ``max_response_bytes`` (a larger one is abandoned unread: ``reply_too_large``, not retried), the header ``Idempotency-Key`` (reward name and
   sample uid: a retried request is one request to a server that honours it, and two rewards
   scoring the same sample never share a key) and ``Authorization: Bearer`` with the key from the
   environment variable ``api_key_env`` (read, stripped and checked when the client is built,
   never logged or put in errors);
6. on a timeout, a connection error, 429, 5xx, a reply that is not a JSON object (truncated,
   malformed) or one the caller's ``check`` rejects (a reply echoing another request's id,
   ``mismatched_reply``, counted in ``asyncrl_reward_mismatched_replies``): up to ``max_retries``
   retries, sleeping ``uniform(0, min(backoff_max_s, backoff_base_s · 2^attempt))`` (exponential backoff, full jitter), or the server's
   ``Retry-After`` seconds in full when it sends one; a ``Retry-After`` beyond
   ``max_retry_after_s`` fails the call at once (``retry_after_too_long``). Other 4xx fail at
   once: retrying would give the same answer. A reply with status 200 whose body is an error
   (``{"error": {"type": "overloaded_error", ...}}``, as proxies and some providers send) is
   classified like the status it stands for (``error_body_failure``: rate limited -> ``http_429``,
   overloaded or unnamed -> ``http_5xx``, invalid request -> ``http_4xx``), and a reply of the
   wrong shape (a caller's ``check`` finding no score field or no choices: ``bad_reply``) like a
   malformed one: retried.

What still fails raises ``CallFailed(kind)``; the reward turns it into ``Unscored(kind)``. A
closed client is closed for good: calls fail with ``client_closed`` and no request is sent.

The limits are one budget per API key and host, shared by every reward calling it, in this
process and in every reward worker of the run (``asyncrl.rewards.budget``): the slots and buckets
of 2 and 4 are a ``SharedLimiter`` holding this worker's share, which the owner of the reward
stream leases it. A client built without one (a test, a benchmark) has the whole budget to itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable

from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.observability.metrics import REWARD_ERRORS, REWARD_MISMATCHED, REWARD_REQUESTS, REWARD_RETRIES
from asyncrl.rewards.breaker import PASS, PROBE, CircuitBreaker
from asyncrl.rewards.budget import RateBudgets, SharedLimiter

log = logging.getLogger(__name__)

RETRYABLE = ("timeout", "connection", "http_429", "http_5xx", "bad_json", "bad_reply", "mismatched_reply")
REFUSALS = ("circuit_open", "client_closed")
"""Kinds of failure the client decides itself, without asking the API: they say nothing of its health."""


class HttpConfig(Config):
    """How a reward calls its API."""

    url: str
    """Endpoint to POST to, e.g. ``http://127.0.0.1:8000/v1/chat/completions``."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (sent as a Bearer token; surrounding
    whitespace is stripped; a key with whitespace, control or non-ASCII characters inside is
    refused when the worker starts); None sends none."""
    concurrency: int = Field(32, ge=1)
    """Requests in flight at most, in total over every reward worker of the run calling this host
    with this ``api_key_env`` (one budget: ``asyncrl.rewards.budget``; each live worker gets a share, at least 1)."""
    rpm: float | None = Field(None, gt=0)
    """Requests per minute at most (token bucket); None: unlimited. In total over every reward worker
    calling this host with this ``api_key_env`` (one budget, shared as ``concurrency`` is)."""
    tpm: float | None = Field(None, gt=0)
    """Tokens per minute at most (token bucket, each call charged in full, estimated: the judge's
    prompt characters / 4 + max_tokens, a JSON scorer's request bytes / 4); None: unlimited. In
    total over every reward worker calling this host with this ``api_key_env`` (one budget)."""
    burst_s: float = Field(1.0, gt=0, le=60)
    """Seconds of the rpm/tpm limits a burst may spend at once: bucket capacity = rate · burst_s."""
    timeout_s: float = Field(30.0, gt=0)
    """Deadline of one request, connection included."""
    max_retries: int = Field(4, ge=0)
    """Retries after the first attempt on a timeout, connection error, 429, 5xx or malformed reply."""
    backoff_base_s: float = Field(0.5, gt=0)
    """First backoff ceiling; attempt k sleeps uniform(0, min(backoff_max_s, base·2^k))."""
    backoff_max_s: float = Field(30.0, gt=0)
    """Largest backoff sleep between retries (a server's Retry-After is honoured in full up to max_retry_after_s)."""
    max_retry_after_s: float = Field(120.0, gt=0)
    """Longest Retry-After waited for; a server asking for longer fails the call at once (``retry_after_too_long``)."""
    max_response_bytes: int = Field(1 << 20, ge=1024)
    """Largest reply read, in bytes (1 MiB by default; a judge's reply is a few KiB). The reply is read
    in chunks and a larger one is abandoned as soon as it passes this (or its Content-Length says so):
    the sample is unscored (``reply_too_large``, not retried), and a worker's memory for replies stays
    below concurrency · max_response_bytes."""
    breaker_failures: int = Field(20, ge=1)
    """Consecutive failed calls (after their retries) that open the circuit breaker."""
    breaker_cooldown_s: float = Field(10.0, gt=0)
    """Seconds the open breaker fails calls at once before one probe call tests the API again."""


class CallFailed(Exception):
    """A call that failed for good; ``kind`` labels it (``http_429``, ``timeout``, ``bad_json``...)."""

    def __init__(self, kind: str, detail: str = "", retry_after: float | None = None):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail
        self.retry_after = retry_after
        self.retryable = kind in RETRYABLE


def read_api_key(env: str | None) -> str | None:
    """The API key in environment variable ``env``, stripped; a ValueError (that never shows the
    key) if it is unset, empty or holds characters an HTTP header cannot carry."""
    if env is None:
        return None
    raw = os.environ.get(env)
    if raw is None:
        raise ValueError(f"api_key_env ({env!r}) names an environment variable that is not set")
    key = raw.strip()
    if not key:
        raise ValueError(f"the API key in ${env} is empty (or only whitespace)")
    for position, char in enumerate(key):
        if not 33 <= ord(char) <= 126:
            what = "whitespace" if char.isspace() else "a control character" if ord(char) < 32 else "non-ASCII"
            raise ValueError(
                f"the API key in ${env} has {what} at position {position}; a key must be printable ASCII "
                "without spaces (the key itself is not shown)"
            )
    return key


class HttpClient:
    """POST JSON with the limits, retries and breaker of ``HttpConfig``; one per reward.

    ``limiter``: the slots and buckets of the reward's budget, shared with the other rewards of
    the process that call the same API with the same key (``RateBudgets.limiter``); None: its own.
    """

    def __init__(self, name: str, cfg: HttpConfig, limiter: SharedLimiter | None = None):
        self.name = name
        self.cfg = cfg
        self._key = read_api_key(cfg.api_key_env)
        self.breaker = CircuitBreaker(name, cfg.breaker_failures, cfg.breaker_cooldown_s)
        self.breaker.on_open = self._fail_waiting
        self._waiting: set[asyncio.Future] = set()  # one per call let through that waits for the rate
        self.limiter = limiter if limiter is not None else RateBudgets().limiter(cfg)  # never two for a budget
        self._session = None
        self._closed = False
        self.requests = self.retries = 0

    def __repr__(self) -> str:  # never show the key
        return f"HttpClient({self.name!r}, url={self.cfg.url!r})"

    def _open(self):
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=self.cfg.concurrency, limit_per_host=self.cfg.concurrency)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        """Close for good: calls in flight and later ones fail with ``client_closed``."""
        self._closed = True
        if self._session is not None:
            await self._session.close()

    async def post_json(
        self, body: dict, idempotency_key: str, tokens: float | None = None, check: Callable[[dict], None] | None = None
    ) -> dict:
        """The JSON object replied to ``body``, or ``CallFailed`` after the retries.

        ``tokens``: what the call costs in the ``tpm`` bucket; None estimates the body's bytes / 4.
        ``check(reply)``: raises ``CallFailed`` for a reply the caller cannot use (one echoing
        another request's id: ``mismatched_reply``, retried), counted and retried like the others.
        """
        data = json.dumps(body).encode()
        tokens = len(data) / 4 if tokens is None else tokens
        attempt = 0
        while True:
            try:
                reply = await self._attempt(data, idempotency_key, tokens, check)
            except CallFailed as e:
                if e.kind == "mismatched_reply":
                    REWARD_MISMATCHED.labels(self.name).inc()
                REWARD_ERRORS.labels(self.name, e.kind).inc()
                if not e.retryable or attempt >= self.cfg.max_retries:
                    if e.kind not in REFUSALS:
                        self.breaker.failed(e.kind)
                    raise
                ceiling = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2**attempt)
                delay = random.uniform(0, ceiling)
                if e.retry_after is not None:  # in full (at most max_retry_after_s: see _send), a little later
                    delay = e.retry_after + random.uniform(0, 0.1 * ceiling)
                attempt += 1
                self.retries += 1
                REWARD_RETRIES.labels(self.name).inc()
                await asyncio.sleep(delay)
                continue
            self.breaker.succeeded()
            return reply

    async def _attempt(self, data: bytes, idempotency_key: str, tokens: float, check) -> dict:
        if self._closed:
            raise CallFailed("client_closed", "the reward's client was closed")
        ticket = self.breaker.admit()
        if ticket is None:
            raise CallFailed("circuit_open", f"after {self.breaker.consecutive} consecutive failed calls")
        try:
            reply = await self._send(data, idempotency_key, tokens, ticket)
            if check is not None:  # part of the attempt: a probe's rejected reply re-opens the breaker
                check(reply)
            return reply
        except BaseException as e:  # the probe's one attempt ended without a reply: re-open
            if ticket == PROBE:
                kind = e.kind if isinstance(e, CallFailed) else type(e).__name__
                self.breaker.probe_failed(kind)
                if isinstance(e, CallFailed):
                    e.retryable = False  # the probe gets one attempt; the breaker is open again
            raise

    async def _send(self, data: bytes, idempotency_key: str, tokens: float, ticket: str) -> dict:
        import aiohttp

        async with self.limiter.slots:
            if ticket == PASS and self.breaker.state != "closed":
                raise CallFailed("circuit_open", "the breaker opened while this call waited")
            if ticket == PASS:  # the breaker opening while this call waits fails it at once
                await self._wait_unless_opened(self._wait_for_rate(tokens))
            else:  # the probe: it alone goes out half open
                await self._wait_for_rate(tokens)
            if self._closed:
                raise CallFailed("client_closed", "the reward's client was closed")
            session = self._open()
            headers = {"Idempotency-Key": idempotency_key, "Content-Type": "application/json"}
            if self._key is not None:
                headers["Authorization"] = f"Bearer {self._key}"
            self.requests += 1
            REWARD_REQUESTS.labels(self.name).inc()
            try:
                timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
                async with session.post(self.cfg.url, data=data, headers=headers, timeout=timeout) as resp:
                    if resp.status == 429 or resp.status >= 500:
                        raise self._rate_or_server_error(resp.status, resp.headers.get("Retry-After"))
                    if resp.status >= 400:
                        raise CallFailed("http_4xx", f"status {resp.status}")
                    text = await self._read(resp)
            except asyncio.TimeoutError:
                raise CallFailed("timeout", f"no reply within {self.cfg.timeout_s} s") from None
            except (aiohttp.ClientError, RuntimeError) as e:  # RuntimeError: the session was closed under it
                if self._closed:
                    raise CallFailed("client_closed", "the reward's client was closed") from None
                if isinstance(e, RuntimeError):
                    raise
                raise CallFailed("connection", type(e).__name__) from None
        try:
            reply = json.loads(text)
        except ValueError:
            raise CallFailed("bad_json", repr(text[:80])) from None
        if not isinstance(reply, dict):
            raise CallFailed("bad_json", f"a JSON {type(reply).__name__}, not an object")
        if reply.get("error"):  # an error under a 200 (proxies, some providers): as its status would be
            raise error_body_failure(reply["error"])
        return reply

    async def _wait_for_rate(self, tokens: float) -> None:
        while (pause := self.limiter.paused_until - time.monotonic()) > 0:  # at most max_retry_after_s
            await asyncio.sleep(pause)
        await self.limiter.take(tokens)

    async def _wait_unless_opened(self, waiting) -> None:
        """Await ``waiting`` (a Retry-After pause, the rate's tokens), or fail it as ``circuit_open``
        as soon as the breaker opens: a queued call never goes out to an API found dead meanwhile."""
        opened = asyncio.get_running_loop().create_future()
        self._waiting.add(opened)
        task = asyncio.ensure_future(waiting)
        try:
            await asyncio.wait((task, opened), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiting.discard(opened)
            if not task.done():
                task.cancel()  # a bucket's waiter takes no tokens when cancelled
                await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled():
            task.result()  # re-raises what the wait raised
        if opened.done() or self.breaker.state != "closed":
            raise CallFailed("circuit_open", "the breaker opened while this call waited for the rate")

    def _fail_waiting(self) -> None:
        for opened in self._waiting:
            if not opened.done():
                opened.set_result(None)

    async def _read(self, resp) -> str:
        """The reply's text, read in chunks; ``reply_too_large`` once it passes ``max_response_bytes``."""
        limit = self.cfg.max_response_bytes
        if resp.content_length is not None and resp.content_length > limit:
            raise CallFailed("reply_too_large", f"Content-Length {resp.content_length} > max_response_bytes ({limit})")
        body = bytearray()
        async for chunk in resp.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > limit:  # the connection is closed unread, not drained
                raise CallFailed("reply_too_large", f"more than max_response_bytes ({limit}) bytes")
        return body.decode(resp.charset or "utf-8", errors="replace")  # JSON is UTF-8 unless it says otherwise

    def _rate_or_server_error(self, status: int, retry_after_header: str | None) -> CallFailed:
        kind = "http_429" if status == 429 else "http_5xx"
        retry_after = _retry_after(retry_after_header)
        if retry_after is None:
            return CallFailed(kind, f"status {status}")
        if retry_after > self.cfg.max_retry_after_s:
            return CallFailed(
                "retry_after_too_long",
                f"status {status} asks to wait {retry_after:g} s, over max_retry_after_s ({self.cfg.max_retry_after_s:g})",
            )
        self.limiter.paused_until = max(self.limiter.paused_until, time.monotonic() + retry_after)
        return CallFailed(kind, f"status {status}, Retry-After {retry_after:g} s", retry_after=retry_after)


RATE_LIMITED = ("rate_limit", "too_many_requests", "quota", "throttl")
OVERLOADED = ("overload", "unavailable", "server_error", "internal", "timeout", "busy", "api_error", "capacity")
INVALID = ("invalid", "bad_request", "context_length", "not_found", "permission", "authentication", "unsupported")


def error_body_failure(error) -> CallFailed:
    """The failure an error body under HTTP 200 stands for, classified as its status would be.

    ``error``: the reply's ``error`` field, an object (``{"type": "overloaded_error", "message":
    ...}``, OpenAI's and Anthropic's shape; a numeric ``code`` or ``status`` counts as the status)
    or a string. Rate limited -> ``http_429`` and overloaded or unknown -> ``http_5xx`` (retried
    with backoff); an invalid request -> ``http_4xx`` (not retried: the sample is unscored, the
    message its detail).
    """
    fields = error if isinstance(error, dict) else {"message": error}
    words = " ".join(str(fields.get(k, "")) for k in ("type", "code", "status", "message")).lower()
    detail = f"an error under status 200: {json.dumps(error)[:160]}"
    status = next((v for v in (fields.get("code"), fields.get("status")) if isinstance(v, int)), None)
    if status == 429 or any(w in words for w in RATE_LIMITED):
        return CallFailed("http_429", detail)
    if status is not None and 400 <= status < 500 or any(w in words for w in INVALID):
        return CallFailed("http_4xx", detail)
    return CallFailed("http_5xx", detail)  # overloaded, a server error, or one it does not name


def _retry_after(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header given in seconds; None if absent or an HTTP date."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
