"""The HTTP reward client's circuit breaker: stop calling an API that is down, and notice when it is back.

States and transitions::

    closed --(failures consecutive failed calls)--> open --(cooldown_s)--> half_open
    half_open --(the probe succeeds)--> closed
    half_open --(the probe fails, or is refused or cancelled before it answers)--> open

Closed, every call goes through. Open, every call is refused at once (the caller fails it as
``circuit_open``, not retried). Half open, ``admit`` hands exactly one call the probe; every other
call is refused until the probe's single attempt settles the state: the probe never retries, and
whatever ends it (a reply, a failure, a refusal by a later limit, a cancellation) closes or
re-opens the breaker, so the breaker cannot stay half open. A success of any call (one sent before
the breaker opened, say) closes it too: the API answered.

Failures of calls other than the probe do not move an open or half-open breaker: the cooldown runs
from the opening, so stragglers from before the outage do not postpone the probe.

Every transition is logged (open: after how many failures and of what kind; closed: after how many
seconds) and exported: ``asyncrl_reward_breaker_state{reward}`` (0 closed, 1 half open, 2 open),
``asyncrl_reward_breaker_transitions_total{reward,state}`` and
``asyncrl_reward_breaker_recovery_seconds{reward}`` (from opening to closing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from asyncrl.observability.metrics import BREAKER_RECOVERY, BREAKER_STATE, BREAKER_TRANSITIONS

log = logging.getLogger(__name__)

State = Literal["closed", "half_open", "open"]
STATE_VALUES: dict[State, int] = {"closed": 0, "half_open": 1, "open": 2}

PASS = "pass"
"""``admit``'s answer to a call made while the breaker is closed."""
PROBE = "probe"
"""``admit``'s answer to the one call that tests a half-open breaker."""


class CircuitBreaker:
    """Closed -> open after ``failures`` consecutive failed calls -> half open after ``cooldown_s``.

    >>> b = CircuitBreaker("judge", failures=1, cooldown_s=10.0)
    >>> b.admit()
    'pass'
    >>> b.failed("http_5xx"); b.state
    'open'
    """

    def __init__(self, name: str, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        if failures < 1:
            raise ValueError(f"failures ({failures}) must be at least 1")
        if cooldown_s <= 0:
            raise ValueError(f"cooldown_s ({cooldown_s}) must be > 0")
        self.name = name
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state: State = "closed"
        self.consecutive = 0
        self.opened_at: float | None = None  # when it last went open
        self.outage_since: float | None = None  # when it first opened, for the recovery time
        self.on_open: Callable[[], None] | None = None
        """Called at each opening (the client fails the calls it let through that still wait)."""
        BREAKER_STATE.labels(name).set(0)

    def admit(self) -> str | None:
        """``PASS`` when closed, ``PROBE`` for the one call let through half open, None: refused."""
        if self.state == "closed":
            return PASS
        if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
            self._move("half_open")
            log.info("%s: circuit breaker half open after %.1f s: one probe call", self.name, self.cooldown_s)
            return PROBE
        return None

    def succeeded(self) -> None:
        """A call (the probe or any other) got its reply: the API is up."""
        self.consecutive = 0
        if self.state != "closed":
            recovery = self.clock() - self.outage_since
            self._move("closed")
            BREAKER_RECOVERY.labels(self.name).observe(recovery)
            log.warning(
                "%s: circuit breaker closed: the API answers again, %.1f s after it opened", self.name, recovery
            )
            self.opened_at = self.outage_since = None

    def failed(self, kind: str) -> None:
        """A call other than the probe failed for good (after its retries) with ``kind``."""
        self.consecutive += 1
        if self.state == "closed" and self.consecutive >= self.failures:
            self.opened_at = self.outage_since = self.clock()
            self._move("open")
            log.warning(
                "%s: circuit breaker open after %d consecutive failed calls (last: %s); calls fail at once for %.1f s",
                self.name,
                self.consecutive,
                kind,
                self.cooldown_s,
            )

    def probe_failed(self, kind: str) -> None:
        """The probe failed, was refused or was cancelled (``kind`` says which): open for another cooldown."""
        if self.state != "half_open":
            return  # another call's success closed the breaker meanwhile
        self.opened_at = self.clock()
        self._move("open")
        log.info("%s: circuit breaker probe failed (%s): open for another %.1f s", self.name, kind, self.cooldown_s)

    def _move(self, state: State) -> None:
        self.state = state
        BREAKER_STATE.labels(self.name).set(STATE_VALUES[state])
        BREAKER_TRANSITIONS.labels(self.name, state).inc()
        if state == "open" and self.on_open is not None:
            self.on_open()
