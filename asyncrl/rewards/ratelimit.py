"""The HTTP reward client's rate limits: a token bucket that may go into debt.

A bucket refills continuously at ``rate_per_min / 60`` tokens per second up to ``capacity``
(``rate · burst_s``: a smooth rate, not a minute's burst at once). ``take(n)`` waits until the
bucket holds ``min(n, capacity)`` tokens, then takes all ``n``: a request larger than the bucket
still goes (alone, once the bucket is full) and leaves the bucket in debt, which the requests after
it pay back by waiting. So over any window of T seconds the tokens spent are at most
``capacity + rate · T`` plus the one request that went into debt, whatever the sizes.

Waiters are served first come, first served. The client takes tokens last, holding its
concurrency slot and after the circuit breaker let it through (``asyncrl.rewards.http``): tokens
are never taken by a call that then waits for something else, so nobody hoards them for a burst.
"""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """``rate_per_min`` tokens per minute, holding at most ``capacity`` (default: one minute's).

    >>> bucket = TokenBucket(rate_per_min=600, capacity=10)  # 10 per second, bursts of 10
    """

    def __init__(self, rate_per_min: float, capacity: float | None = None):
        if rate_per_min <= 0:
            raise ValueError(f"rate_per_min ({rate_per_min}) must be > 0")
        self.rate = rate_per_min / 60.0  # tokens per second
        self.capacity = capacity if capacity is not None else rate_per_min
        if self.capacity <= 0:
            raise ValueError(f"capacity ({self.capacity}) must be > 0")
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    def resize(self, rate_per_min: float, capacity: float) -> None:
        """A new rate and capacity from now on (a worker's share of a shared budget changed): what
        was earned so far at the old rate is kept, up to the new capacity; a debt is kept in full."""
        if rate_per_min <= 0 or capacity <= 0:
            raise ValueError(f"rate_per_min ({rate_per_min}) and capacity ({capacity}) must be > 0")
        self._refill()
        self.rate, self.capacity = rate_per_min / 60.0, capacity
        self.tokens = min(self.tokens, capacity)

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def take(self, n: float = 1.0) -> None:
        """Wait until ``min(n, capacity)`` tokens are there, then take ``n`` (FIFO among waiters).

        The wait is bounded: at most (the debt + ``capacity``) / rate, plus the waits of those ahead.
        """
        if n < 0:
            raise ValueError(f"n ({n}) must be >= 0")
        need = min(n, self.capacity)
        async with self._lock:
            while True:
                self._refill()
                if self.tokens >= need:
                    self.tokens -= n  # may go below 0: the debt of a request larger than the bucket
                    return
                await asyncio.sleep((need - self.tokens) / self.rate)
                need = min(n, self.capacity)  # resized meanwhile
