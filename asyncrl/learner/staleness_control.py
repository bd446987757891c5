"""``buffer.max_staleness: auto``: the learner raises and lowers the staleness bound from the
off-policy signals of its own steps.

Every asynchronous system asks for a staleness bound η: too low and generators idle waiting for
admission, too high and stale samples degrade learning. The learner already measures how far each
batch is off-policy (``asyncrl.learner.step_stats``):

- ``ess``: the effective sample size of the raw importance weights w = pi_prox / mu over the
  batch's response tokens, (Σw)² / (N·Σw²) (Kong's estimate; 1 on-policy, → 1/N when one token
  carries all the weight);
- ``kl``: the k3 estimate of KL(mu ‖ pi_prox) per token of the batch's *stalest* samples (from
  ``behaviour_kl_by_staleness``): the samples a lower bound would not have admitted.

The rule (``StalenessController.observe``), additive increase and multiplicative decrease with a
band of hysteresis between:

- **breach**, ``ess < ess_min`` or ``kl > kl_max``: after ``lower_after`` such steps in a row the
  bound becomes max(min, min(bound − 1, ⌊bound · decrease⌋));
- **healthy**, kl ≤ margin·kl_max and 1 − ess ≤ margin·(1 − ess_min), on a step whose stalest
  sample reached the bound (the bound limits the run, and the signals were measured where it
  lets samples be): after ``raise_after`` such steps in a row, bound + 1, up to max. A healthy step
  below the bound neither counts nor resets the count: it says nothing about the bound;
- anything else (inside the limits, outside the margin) holds the bound and resets both counts.

Where the decision goes: the learner sends the bound with each batch request (``want_batch``);
the buffer's gate applies it before that request's version and passes both on in
``buffer_status`` to the dispatcher's admission, so gate and admission move together and in
order with the versions. The bound is part of the learner's checkpoint (``state``), each step's
bound and the reason of a change are in its ``step`` event (``steps.jsonl``), and the Prometheus
gauge ``asyncrl_staleness_bound`` and counter ``asyncrl_staleness_bound_changes_total`` follow it.

    >>> from asyncrl.buffer.config import AutoStalenessConfig
    >>> c = StalenessController(AutoStalenessConfig(start=2, raise_after=2))
    >>> [c.observe(Signals(ess=0.99, kl=0.001, staleness_max=2)) for _ in range(2)][-1]
    'raise 2 -> 3: kl 0.001 <= 0.025, ess 0.99 >= 0.75 for 2 steps at the bound'
    >>> c.observe(Signals(ess=0.3, kl=0.001, staleness_max=3))
    'lower 3 -> 1: ess 0.3 < 0.5'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.observability.metrics import BEHAVIOUR_ESS, STALENESS_BOUND, STALENESS_BOUND_CHANGES
from asyncrl.observability.step_stats import StepStats

if TYPE_CHECKING:
    from asyncrl.config import AutoStalenessConfig  # the buffer's section, through the root config


@dataclass
class Signals:
    """One step's off-policy signals."""

    ess: float
    """Effective sample size of the raw importance weights pi_prox / mu, in (0, 1]."""
    kl: float
    """k3 KL(mu ‖ pi_prox) per token of the step's stalest samples."""
    staleness_max: int
    """The staleness of those samples."""


def step_signals(stats: StepStats) -> Signals | None:
    """The signals of a step's stats (``behaviour_ess``, ``behaviour_kl_by_staleness``); None
    when the trainer did not measure them or they are not finite."""
    ess, by_staleness = stats.behaviour_ess, stats.behaviour_kl_by_staleness
    if ess is None or not by_staleness:
        return None
    stalest = max(by_staleness)
    kl = float(by_staleness[stalest])
    if not (math.isfinite(ess) and math.isfinite(kl)):
        return None
    return Signals(ess=float(ess), kl=kl, staleness_max=stalest)


class StalenessController:
    """The rule of the module docstring: ``observe`` a step's signals, read ``bound``."""

    def __init__(self, cfg: AutoStalenessConfig):
        self.cfg = cfg
        self.bound = cfg.start
        """The staleness bound in force for the batches to come."""
        self.healthy = 0
        """Healthy steps at the bound in a row (towards a raise)."""
        self.breached = 0
        """Steps breaking a limit in a row (towards a lowering)."""

    def observe(self, s: Signals) -> str | None:
        """Take one step's signals; return why the bound changed, or None when it holds."""
        c = self.cfg
        breaches = []
        if s.kl > c.kl_max:
            breaches.append(f"kl {s.kl:.3g} > {c.kl_max:.3g}")
        if s.ess < c.ess_min:
            breaches.append(f"ess {s.ess:.3g} < {c.ess_min:.3g}")
        if breaches:
            self.healthy, self.breached = 0, self.breached + 1
            if self.breached < c.lower_after or self.bound <= c.min:
                return None
            return self._set(max(c.min, min(self.bound - 1, math.floor(self.bound * c.decrease))), ", ".join(breaches))
        self.breached = 0
        kl_ok, ess_ok = c.margin * c.kl_max, 1.0 - c.margin * (1.0 - c.ess_min)
        if s.kl > kl_ok or s.ess < ess_ok:
            self.healthy = 0  # inside the limits, outside the margin: hold
            return None
        if s.staleness_max < self.bound:
            return None  # healthy below the bound: no evidence about the bound itself
        self.healthy += 1
        if self.healthy < c.raise_after or self.bound >= c.max:
            return None
        steps = f"{c.raise_after} step" + ("s" if c.raise_after > 1 else "")
        why = f"kl {s.kl:.3g} <= {kl_ok:.3g}, ess {s.ess:.3g} >= {ess_ok:.3g} for {steps} at the bound"
        return self._set(self.bound + 1, why)

    def _set(self, bound: int, why: str) -> str:
        verb = "raise" if bound > self.bound else "lower"
        reason = f"{verb} {self.bound} -> {bound}: {why}"
        self.bound, self.healthy, self.breached = bound, 0, 0
        return reason

    def state(self) -> dict:
        """What a checkpoint keeps: the bound and both counts."""
        return {"bound": self.bound, "healthy": self.healthy, "breached": self.breached}

    def load_state(self, state: dict) -> None:
        """Restore ``state()``; a bound outside today's [min, max] is brought within it."""
        self.bound = min(self.cfg.max, max(self.cfg.min, int(state["bound"])))
        self.healthy, self.breached = int(state.get("healthy", 0)), int(state.get("breached", 0))


class AutoStaleness:
    """The learner loop's side of the controller: decide after each step, record the decision.

    ``after_step(stats)`` observes the step, sets the Prometheus figures and records in the step's
    stats ``staleness_bound`` and, on a change, ``staleness_bound_reason``.
    """

    def __init__(self, cfg: AutoStalenessConfig):
        self.controller = StalenessController(cfg)
        STALENESS_BOUND.labels("learner").set(self.bound)

    @property
    def bound(self) -> int:
        return self.controller.bound

    def after_step(self, stats: StepStats) -> None:
        signals = step_signals(stats)
        reason = None
        if signals is not None:
            BEHAVIOUR_ESS.set(signals.ess)
            reason = self.controller.observe(signals)
        STALENESS_BOUND.labels("learner").set(self.bound)
        stats.staleness_bound = self.bound
        if reason is not None:
            STALENESS_BOUND_CHANGES.labels(reason.split(" ", 1)[0]).inc()
            stats.staleness_bound_reason = reason
