"""An async HTTP client for rewards behind an API: limits, timeouts, retries, a circuit breaker.

One ``HttpClient`` per reward. A call (``post_json``) goes through, in order:

1. a semaphore of ``concurrency`` requests in flight;
2. the circuit breaker: after ``breaker_failures`` consecutive failed calls it opens and every call
   fails at once (``circuit_open``, not retried) for ``breaker_cooldown_s``; then one probe call is
   let through (half open) and its outcome closes or re-opens it;
3. two token buckets: ``rpm`` requests and ``tpm`` tokens per minute, refilled continuously,
   holding ``burst_s`` seconds' worth (a smooth rate, not a minute's burst at once); a call waits
   until its tokens are there (a call larger than the bucket waits for a full one);
4. the request, with a ``timeout_s`` deadline, the header ``Idempotency-Key`` (the sample uid, so
   a retried request is one request to a server that honours it) and ``Authorization: Bearer``
   from the environment variable ``api_key_env`` (read once, never logged or put in errors);
5. on a timeout, a connection error, 429 or 5xx: up to ``max_retries`` retries, sleeping
   ``uniform(0, min(backoff_max_s, backoff_base_s · 2^attempt))`` (exponential backoff, full
   jitter), or the server's ``Retry-After`` seconds when it sends one (capped at backoff_max_s).
   Other 4xx and malformed JSON fail at once: retrying would give the same answer.

What still fails raises ``CallFailed(kind)``; the reward turns it into ``Unscored(kind)``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time

from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.observability.metrics import REWARD_ERRORS, REWARD_REQUESTS, REWARD_RETRIES

log = logging.getLogger(__name__)

RETRYABLE = ("timeout", "connection", "http_429", "http_5xx")


class HttpConfig(Config):
    """How a reward calls its API."""

    url: str
    """Endpoint to POST to, e.g. ``http://127.0.0.1:8000/v1/chat/completions``."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (sent as a Bearer token); None sends none."""
    concurrency: int = Field(32, ge=1)
    """Requests in flight at most."""
    rpm: float | None = Field(None, gt=0)
    """Requests per minute at most (token bucket); None: unlimited."""
    tpm: float | None = Field(None, gt=0)
    """Tokens (prompt + completion, estimated) per minute at most (token bucket); None: unlimited."""
    burst_s: float = Field(1.0, gt=0, le=60)
    """Seconds of the rpm/tpm limits a burst may spend at once: bucket capacity = rate · burst_s."""
    timeout_s: float = Field(30.0, gt=0)
    """Deadline of one request, connection included."""
    max_retries: int = Field(4, ge=0)
    """Retries after the first attempt on a timeout, connection error, 429 or 5xx."""
    backoff_base_s: float = Field(0.5, gt=0)
    """First backoff ceiling; attempt k sleeps uniform(0, min(backoff_max_s, base·2^k))."""
    backoff_max_s: float = Field(30.0, gt=0)
    """Largest sleep between retries, Retry-After included."""
    breaker_failures: int = Field(20, ge=1)
    """Consecutive failed calls (after their retries) that open the circuit breaker."""
    breaker_cooldown_s: float = Field(10.0, gt=0)
    """Seconds the open breaker fails calls at once before letting a probe through."""


class CallFailed(Exception):
    """A call that failed for good; ``kind`` labels it (``http_429``, ``timeout``, ``bad_json``...)."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


class TokenBucket:
    """``rate_per_min`` tokens per minute, holding at most ``capacity`` (default: one minute's)."""

    def __init__(self, rate_per_min: float, capacity: float | None = None):
        self.rate = rate_per_min / 60.0  # tokens per second
        self.capacity = capacity if capacity is not None else rate_per_min
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: float = 1.0) -> None:
        """Wait until ``n`` tokens are there, then take them (FIFO among waiters)."""
        n = min(n, self.capacity)  # one request bigger than the bucket still goes, alone
        async with self._lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                await asyncio.sleep((n - self.tokens) / self.rate)


class CircuitBreaker:
    """Closed -> open after ``failures`` consecutive failures -> half open after ``cooldown_s``."""

    def __init__(self, failures: int, cooldown_s: float):
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.consecutive = 0
        self.opened_at: float | None = None
        self.probing = False

    def allow(self) -> bool:
        if self.opened_at is None:
            return True
        if time.monotonic() - self.opened_at >= self.cooldown_s and not self.probing:
            self.probing = True  # half open: one call decides
            return True
        return False

    def record(self, ok: bool) -> None:
        self.probing = False
        if ok:
            self.consecutive, self.opened_at = 0, None
            return
        self.consecutive += 1
        if self.consecutive >= self.failures or self.opened_at is not None:
            if self.opened_at is None:
                log.warning("circuit breaker opens after %d consecutive failures", self.consecutive)
            self.opened_at = time.monotonic()


class HttpClient:
    """POST JSON with the limits, retries and breaker of ``HttpConfig``; one per reward."""

    def __init__(self, name: str, cfg: HttpConfig):
        self.name = name
        self.cfg = cfg
        self._key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if cfg.api_key_env and self._key is None:
            raise ValueError(f"api_key_env ({cfg.api_key_env!r}) names an environment variable that is not set")
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
        self.rpm = TokenBucket(cfg.rpm, max(1.0, cfg.rpm * cfg.burst_s / 60)) if cfg.rpm else None
        self.tpm = TokenBucket(cfg.tpm, max(1.0, cfg.tpm * cfg.burst_s / 60)) if cfg.tpm else None
        self._semaphore: asyncio.Semaphore | None = None
        self._session = None
        self.requests = self.retries = 0

    def __repr__(self) -> str:  # never show the key
        return f"HttpClient({self.name!r}, url={self.cfg.url!r})"

    async def _open(self):
        if self._session is None:
            import aiohttp

            self._semaphore = asyncio.Semaphore(self.cfg.concurrency)
            connector = aiohttp.TCPConnector(limit=self.cfg.concurrency, limit_per_host=self.cfg.concurrency)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post_json(self, body: dict, idempotency_key: str, tokens: float = 0.0) -> dict:
        """The JSON reply to ``body``, or ``CallFailed`` after the retries."""
        try:
            reply = await self._with_retries(body, idempotency_key, tokens)
        except CallFailed as e:
            if e.kind != "circuit_open":
                self.breaker.record(ok=e.kind not in RETRYABLE and e.kind != "http_4xx")
            raise
        self.breaker.record(ok=True)
        return reply

    async def _with_retries(self, body: dict, idempotency_key: str, tokens: float) -> dict:
        attempt = 0
        while True:
            try:
                return await self._attempt(body, idempotency_key, tokens)
            except CallFailed as e:
                REWARD_ERRORS.labels(self.name, e.kind).inc()
                if e.kind not in RETRYABLE or attempt >= self.cfg.max_retries:
                    raise
                ceiling = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2**attempt)
                delay = random.uniform(0, ceiling)
                retry_after = getattr(e, "retry_after", None)
                if retry_after is not None:
                    delay = min(self.cfg.backoff_max_s, retry_after) + random.uniform(0, 0.1 * ceiling)
                attempt += 1
                self.retries += 1
                REWARD_RETRIES.labels(self.name).inc()
                await asyncio.sleep(delay)

    async def _attempt(self, body: dict, idempotency_key: str, tokens: float) -> dict:
        import aiohttp

        session = await self._open()
        if self.rpm is not None:
            await self.rpm.take(1)
        if self.tpm is not None and tokens > 0:
            await self.tpm.take(tokens)
        headers = {"Idempotency-Key": idempotency_key}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key}"
        async with self._semaphore:
            # Checked once a slot is free, so calls queued behind failing ones fail fast too.
            if not self.breaker.allow():
                raise CallFailed("circuit_open", f"after {self.breaker.consecutive} consecutive failures")
            self.requests += 1
            REWARD_REQUESTS.labels(self.name).inc()
            try:
                timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
                async with session.post(self.cfg.url, json=body, headers=headers, timeout=timeout) as resp:
                    if resp.status == 429 or resp.status >= 500:
                        kind = "http_429" if resp.status == 429 else "http_5xx"
                        failed = CallFailed(kind, f"status {resp.status}")
                        failed.retry_after = _retry_after(resp.headers.get("Retry-After"))
                        raise failed
                    if resp.status >= 400:
                        raise CallFailed("http_4xx", f"status {resp.status}")
                    text = await resp.text()
            except asyncio.TimeoutError:
                raise CallFailed("timeout", f"no reply within {self.cfg.timeout_s} s") from None
            except aiohttp.ClientError as e:
                raise CallFailed("connection", type(e).__name__) from None
        try:
            import json

            reply = json.loads(text)
        except ValueError:
            raise CallFailed("bad_json", repr(text[:80])) from None
        if not isinstance(reply, dict):
            raise CallFailed("bad_json", f"a JSON {type(reply).__name__}, not an object")
        return reply


def _retry_after(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header given in seconds; None if absent or an HTTP date."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
