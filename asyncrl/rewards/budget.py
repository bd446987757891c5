"""Rate budgets shared by every reward worker that calls one API with one key.

A *budget* is what a provider allows one API key: the ``concurrency``, ``rpm`` and ``tpm`` of an
HTTP reward's options (``asyncrl.rewards.http.HttpConfig``). Its id (``budget_id``) is a hash of
the key's environment variable name (``api_key_env``, not the key) and the URL's scheme, host and
port: two rewards calling one host with one key draw on one budget, whatever their paths, and no
secret ever goes into a message, a metric or a log (a URL may carry credentials: only its hash does).

In one process, the rewards of one budget share one ``SharedLimiter`` (its token buckets and
slots; ``RateBudgets`` hands them out); the config requires them to state the same limits.

Across processes, the owner of the reward stream (``reward-0``, which hears every hot-plugged worker
at least every 0.1 s: ``asyncrl.rewards.worker``) leases each live worker a share of each budget
(``LeaseTable``), the owner included. With n live workers using a budget, worker i (the owner
first, then the others by name) gets::

    rpm_i = rpm / n        tpm_i = tpm / n
    concurrency_i = ⌊c / n⌋ + (1 if i < c mod n else 0), at least 1

so the API sees at most the budget in total (concurrency: at most max(c, n)). A worker's share goes
to it in a ``rate_lease`` message before its first groups (the DEALER delivers in order), again
whenever the set of live workers changes (a join, a leave, a death: a worker unheard for
``reward.lease_timeout_s``), and renewed every quarter of that. A hot-plugged worker uses
``reward.unleased_share`` of each budget before its first lease and whenever its lease is not
renewed for ``reward.lease_timeout_s`` (the owner gone or stalled): never more than the
conservative share without the owner's word. It applies the smaller of the lease and its own
config's limits.

During a change, for up to one turn of the loops (a few ms), the old shares and the new one
overlap; the token buckets bound what that can cost to one bucket (``burst_s`` of the rate) per worker.
An owner restarted by the controller knows no worker at first and takes the whole budget, while
the others keep their old shares until their leases run out (``lease_timeout_s``), then
``unleased_share`` until their next request for work reaches it (``request_timeout_s``): for those
few seconds the API may see more than the budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from asyncrl.observability.metrics import REWARD_RATE_SHARE
from asyncrl.rewards.ratelimit import TokenBucket
from asyncrl.wire.messages import RateLease, RateShare

log = logging.getLogger(__name__)


def budget_id(url: str, api_key_env: str | None) -> str:
    """The id of the budget of ``api_key_env`` at ``url``'s host: 12 hex digits of a SHA-256.

    >>> budget_id("https://api.example.com/v1/chat", "KEY") == budget_id("https://api.example.com/v1/x", "KEY")
    True
    """
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
    where = f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"
    return hashlib.sha256(f"{api_key_env or ''}\0{where}".encode()).hexdigest()[:12]


def budget_of(cfg) -> RateShare:
    """The whole budget an ``HttpConfig`` states."""
    return RateShare(budget=budget_id(cfg.url, cfg.api_key_env), concurrency=cfg.concurrency, rpm=cfg.rpm, tpm=cfg.tpm)


def split(budget: RateShare, n: int, index: int) -> RateShare:
    """Worker ``index``'s share of ``budget`` among ``n`` (see the module docstring).

    >>> split(RateShare(budget="b", concurrency=5, rpm=600.0), 2, 0)
    RateShare(budget='b', concurrency=3, rpm=300.0, tpm=None)
    """
    if n < 1 or not 0 <= index < n:
        raise ValueError(f"index ({index}) must be in [0, n) and n ({n}) >= 1")
    c = budget.concurrency // n + (1 if index < budget.concurrency % n else 0)
    return RateShare(
        budget=budget.budget,
        concurrency=max(1, c),
        rpm=None if budget.rpm is None else budget.rpm / n,
        tpm=None if budget.tpm is None else budget.tpm / n,
    )


def fraction_of(budget: RateShare, fraction: float) -> RateShare:
    """``fraction`` of ``budget`` (concurrency rounded down, at least 1): the share before a lease."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction ({fraction}) must be in (0, 1]")
    return RateShare(
        budget=budget.budget,
        concurrency=max(1, math.floor(budget.concurrency * fraction)),
        rpm=None if budget.rpm is None else budget.rpm * fraction,
        tpm=None if budget.tpm is None else budget.tpm * fraction,
    )


def smaller(a: RateShare, b: RateShare) -> RateShare:
    """Each limit the smaller of the two (None: unlimited)."""

    def least(x, y):
        return y if x is None else x if y is None else min(x, y)

    return RateShare(
        budget=a.budget, concurrency=min(a.concurrency, b.concurrency), rpm=least(a.rpm, b.rpm), tpm=least(a.tpm, b.tpm)
    )


class Slots:
    """A semaphore whose size can change: ``async with slots:`` holds one of ``limit`` (FIFO).

    Shrunk, calls in flight finish and no new one starts until fewer than the new limit remain.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be >= 1")
        self.limit, self.used = limit, 0
        self._waiters: deque[asyncio.Future] = deque()

    def resize(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be >= 1")
        self.limit = limit
        self._wake()

    async def __aenter__(self) -> None:
        if self.used < self.limit and not self._waiters:
            self.used += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted, then cancelled before it ran: hand the slot on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    async def __aexit__(self, *exc) -> None:
        self._release()

    def _release(self) -> None:
        self.used -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.used += 1
                waiter.set_result(None)


class SharedLimiter:
    """The slots and token buckets of one budget in one process, at this worker's ``share``."""

    def __init__(self, budget: RateShare, burst_s: float):
        self.budget, self.burst_s = budget, burst_s
        self.share: RateShare | None = None
        self.slots = Slots(budget.concurrency)
        self.rpm: TokenBucket | None = None
        self.tpm: TokenBucket | None = None
        self.paused_until = 0.0
        """Monotonic time before which no call on this budget starts (a server's ``Retry-After``)."""
        self.apply(budget)

    def apply(self, share: RateShare) -> None:
        """From now on, at most ``share`` (never more than this process's own budget)."""
        share = smaller(self.budget, share)
        if share == self.share:
            return
        self.share = share
        self.slots.resize(share.concurrency)
        self.rpm = self._bucket(self.rpm, share.rpm)
        self.tpm = self._bucket(self.tpm, share.tpm)
        REWARD_RATE_SHARE.labels(share.budget, "concurrency").set(share.concurrency)
        for limit, value in (("rpm", share.rpm), ("tpm", share.tpm)):
            if value is not None:
                REWARD_RATE_SHARE.labels(share.budget, limit).set(value)

    def _bucket(self, bucket: TokenBucket | None, per_min: float | None) -> TokenBucket | None:
        if per_min is None:
            return None
        capacity = max(1.0, per_min * self.burst_s / 60)
        if bucket is None:
            return TokenBucket(per_min, capacity)
        bucket.resize(per_min, capacity)
        return bucket

    async def take(self, tokens: float) -> None:
        """One request's turn: a ``rpm`` token, then ``tokens`` of ``tpm`` (see ``TokenBucket.take``)."""
        if self.rpm is not None:
            await self.rpm.take(1)
        if self.tpm is not None and tokens > 0:
            await self.tpm.take(tokens)


class RateBudgets:
    """This process's ``SharedLimiter`` per budget id, and the lease it runs under."""

    def __init__(self):
        self.limiters: dict[str, SharedLimiter] = {}
        self.leased_at: float | None = None
        """When the last lease arrived (a hot-plugged worker); None: none yet, or it ran out."""

    def limiter(self, cfg) -> SharedLimiter:
        """The limiter of an ``HttpConfig``'s budget, shared with every reward of this process that
        names the same one; a ValueError when they state different limits."""
        budget = budget_of(cfg)
        limiter = self.limiters.get(budget.budget)
        if limiter is None:
            limiter = self.limiters[budget.budget] = SharedLimiter(budget, cfg.burst_s)
        elif (limiter.budget, limiter.burst_s) != (budget, cfg.burst_s):
            raise ValueError(
                f"the rewards calling {urlsplit(cfg.url).hostname} with api_key_env {cfg.api_key_env!r} share one "
                f"budget and must state the same concurrency, rpm, tpm and burst_s: {limiter.budget} "
                f"(burst_s {limiter.burst_s}) vs {budget} (burst_s {cfg.burst_s})"
            )
        return limiter

    def ids(self) -> list[str]:
        return sorted(self.limiters)

    def apply_fraction(self, fraction: float) -> None:
        """Every budget at ``fraction`` of itself (1: the whole; a hot-plugged worker's unleased share)."""
        for limiter in self.limiters.values():
            limiter.apply(fraction_of(limiter.budget, fraction))

    def apply_lease(self, lease: RateLease, unleased_share: float, now: float | None = None) -> None:
        """The owner's lease; a budget it does not name stays at ``unleased_share``."""
        shares = {s.budget: s for s in lease.shares}
        for bid, limiter in self.limiters.items():
            share = shares.get(bid)
            limiter.apply(share if share is not None else fraction_of(limiter.budget, unleased_share))
        if self.leased_at is None:
            log.info("rate budgets leased: a share of %d live workers' budgets", lease.workers)
        self.leased_at = time.monotonic() if now is None else now

    def expire(self, timeout_s: float, unleased_share: float, now: float | None = None) -> bool:
        """Back to ``unleased_share`` when the lease was not renewed within ``timeout_s``; True if it just ran out."""
        now = time.monotonic() if now is None else now
        if self.leased_at is None or now - self.leased_at <= timeout_s:
            return False
        log.warning("no rate lease from the owner for %.1f s: back to %.3g of each budget", timeout_s, unleased_share)
        self.leased_at = None
        self.apply_fraction(unleased_share)
        return True


@dataclass
class _Peer:
    name: str
    budgets: tuple[str, ...]
    heard: float


class LeaseTable:
    """The owner's side: who is alive, and each one's share of each budget.

    ``heard`` records each request of a hot-plugged worker; ``update`` (after every request
    queued this turn is read, so a stall of the owner's own loop kills nobody) forgets those
    unheard for ``timeout_s``, divides each budget among the owner and the live workers that use
    it, applies the owner's share to its own limiters and returns the leases to send now.

    >>> table = LeaseTable(RateBudgets(), timeout_s=2.0)
    >>> table.heard(b"peer", "reward-1", [], leaving=False)
    >>> list(table.update())
    [b'peer']
    """

    def __init__(self, budgets: RateBudgets, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        self.budgets, self.timeout_s, self.clock = budgets, timeout_s, clock
        self.peers: dict[bytes, _Peer] = {}
        self._sent: dict[bytes, tuple[list[RateShare], float]] = {}

    def heard(self, peer: bytes, name: str, budgets: list[str], leaving: bool) -> None:
        if leaving:
            if self.peers.pop(peer, None) is not None:
                log.info("%s left: its share of the rate budgets goes back to the others", name)
            return
        if peer not in self.peers:
            log.info("%s joined: the rate budgets are divided again", name)
        self.peers[peer] = _Peer(name, tuple(budgets), self.clock())

    def unsent(self, peer: bytes) -> None:
        """The lease to ``peer`` could not go: send it again on the next update."""
        self._sent.pop(peer, None)

    def workers(self, bid: str) -> int:
        """Live workers using budget ``bid``, the owner included."""
        return 1 + sum(bid in p.budgets for p in self.peers.values())

    def update(self) -> dict[bytes, RateLease]:
        now = self.clock()
        for peer in [p for p, x in self.peers.items() if now - x.heard > self.timeout_s]:
            log.warning(
                "%s unheard for %.1f s: taken as gone, its share of the rate budgets goes back to the others",
                self.peers[peer].name,
                self.timeout_s,
            )
            del self.peers[peer]
        order = sorted(self.peers, key=lambda p: (self.peers[p].name, p))
        shares: dict[bytes, list[RateShare]] = {p: [] for p in order}
        for bid, limiter in self.budgets.limiters.items():
            users = [p for p in order if bid in self.peers[p].budgets]
            limiter.apply(split(limiter.budget, 1 + len(users), 0))
            for i, peer in enumerate(users, start=1):
                shares[peer].append(split(limiter.budget, 1 + len(users), i))
        for peer in [p for p in self._sent if p not in self.peers]:
            del self._sent[peer]
        due = {}
        for peer in order:
            last = self._sent.get(peer)
            if last is None or last[0] != shares[peer] or now - last[1] >= self.timeout_s / 4:
                due[peer] = RateLease(shares=shares[peer], workers=1 + len(order))
                self._sent[peer] = (shares[peer], now)
        return due
