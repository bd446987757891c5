"""How long the controller lets the learner go without a step: bounds measured on the run itself.

A fixed bound cannot serve both a toy and a real model: 120 s stops a healthy 7 B run whose steps
take minutes, and an hour lets a hung toy run sit for an hour. ``StallWatch`` learns the scale
from the run. Every interval between two learner progress events (a step, a checkpoint part) is
measured — with the weight publication, the wait for a batch and the checkpoint writes between
them, since those are part of the interval — and the run is declared stalled when the current
interval passes

    bound = clamp(factor × slowest_interval_so_far, floor_s, cap_s)

(``run.stall_factor``, ``run.stall_timeout_s``, ``run.stall_cap_s``). Before the first step there
is nothing to measure: the first interval (the first batch sampled and trained, engines warming
up) gets ``run.first_step_timeout_s``, also clamped. The slowest interval, not a mean, because a
run's slow steps (a checkpoint, a publication, a long batch) recur; the factor leaves room for
one slower still. The warning that names what each process waits for comes earlier, at

    warn_after = max(2 × slowest_interval_so_far, floor_s / 4)

so a step as slow as the slowest seen never triggers it. Other waits of the controller that
scale with the model take their bound from here (``bound``: stopping a stage, which waits for
the batch a generator is sampling; ``scaled``: the final weights reaching every generator).
"""

from __future__ import annotations

import time


class StallWatch:
    """The stall rule above, fed by ``progress`` and asked by ``state``.

    >>> now = [0.0]
    >>> w = StallWatch(factor=4, floor_s=60, cap_s=3600, first_s=600, clock=lambda: now[0])
    >>> w.bound()  # nothing measured yet
    600
    >>> now[0] = 100.0; w.progress(); w.bound()  # a 100 s first interval
    400.0
    >>> now[0] = 350.0; w.state()  # 250 s since: past 2 x 100, short of 400
    'warn'
    >>> now[0] = 501.0; w.state()
    'stalled'
    """

    def __init__(self, factor: float, floor_s: float, cap_s: float, first_s: float, clock=time.monotonic):
        if factor < 1:
            raise ValueError(f"factor ({factor}) must be >= 1: a bound below the slowest step seen stops healthy runs")
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"floor_s ({floor_s}) must be > 0 and <= cap_s ({cap_s})")
        self.factor, self.floor_s, self.cap_s, self.first_s = factor, floor_s, cap_s, first_s
        self.clock = clock
        self.last = clock()
        self.slowest: float | None = None  # the longest interval between progress events so far

    def progress(self, measure: bool = True) -> None:
        """The learner made progress now. ``measure=False`` restarts the clock without taking the
        interval as a measurement (a process restarted, the run restored: not a step's duration)."""
        now = self.clock()
        if measure:
            interval = now - self.last
            self.slowest = interval if self.slowest is None else max(self.slowest, interval)
        self.last = now

    def bound(self) -> float:
        """Seconds the current interval may last before the run is stalled."""
        raw = self.first_s if self.slowest is None else self.factor * self.slowest
        return min(max(raw, self.floor_s), self.cap_s)

    def warn_after(self) -> float:
        """Seconds into the current interval at which the controller says what everyone waits for."""
        if self.slowest is None:
            return self.bound() / 4
        return min(max(2 * self.slowest, self.floor_s / 4), self.bound())

    def waited(self) -> float:
        """Seconds since the last progress."""
        return self.clock() - self.last

    def state(self) -> str:
        """``ok``, ``warn`` (past ``warn_after``) or ``stalled`` (past ``bound``)."""
        waited = self.waited()
        if waited > self.bound():
            return "stalled"
        return "warn" if waited > self.warn_after() else "ok"

    def scaled(self, measured_s: float | None, floor_s: float) -> float:
        """A bound for another wait that grows with the model: ``factor × measured_s``, at least
        ``floor_s``, at most the cap (``floor_s`` alone when nothing was measured)."""
        raw = floor_s if measured_s is None else max(floor_s, self.factor * measured_s)
        return min(raw, max(self.cap_s, floor_s))
