"""KL to the reference policy: per-token estimators and the controllers of its coefficient.

The learner penalises drift from a frozen reference pi_ref (the weights the run started from).
The exact KL needs the whole vocabulary at every position; these estimators use only the
sampled token's log-probabilities (Schulman 2020, "Approximating KL Divergence"). With
log r = logprobs - ref_logprobs on tokens sampled from pi_theta:

- k1 = log r                       unbiased, high variance, can be negative per token;
- k2 = (log r)^2 / 2               biased, low variance, >= 0;
- k3 = 1/r - 1 + log r             unbiased and >= 0 per token: the low-variance default;
- abs = |log r|                    as in verl's "abs" option.

Each is a pure (B, T) -> (B, T) function; ``KL_ESTIMATORS`` maps ``algorithm.kl.estimator``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref, per token, (B, T)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi_theta - log pi_ref)^2 / 2, per token, (B, T)."""
    return 0.5 * (logprobs - ref_logprobs).square()


K3_BOUND = 10.0
"""Bound on one token's k3 value (the references' ±10)."""


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log pi_ref - log pi_theta) - 1 - (log pi_ref - log pi_theta), per token, (B, T).

    The log-ratio is clamped to [-20, 20] before exp so that exp cannot overflow, and the value to
    [-K3_BOUND, K3_BOUND] (as verl and OpenRLHF do) so that one wild token, whose k3 could otherwise
    reach e^20 ~ 4.9e8, cannot swamp the loss; k3 >= 0, so only the upper bound ever acts. Tokens
    past the bound get no gradient from the KL term.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (log_ratio.exp() - 1.0 - log_ratio).clamp(-K3_BOUND, K3_BOUND)


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """abs = |log pi_theta - log pi_ref|, per token, (B, T)."""
    return (logprobs - ref_logprobs).abs()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
}
"""Per-token KL estimators by ``algorithm.kl.estimator``."""


class FixedKLController:
    """beta stays ``coef``; ``update`` does nothing (it has the adaptive controller's signature)."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"coef ({coef}) must be >= 0")
        self.value = coef

    def update(self, current_kl: float, n_samples: int) -> float:
        return self.value


class AdaptiveKLController:
    """Proportional controller of beta towards a target KL (Ziegler et al. 2019, section 2.2).

        error = clip(current_kl / target - 1, -0.2, 0.2)
        beta <- beta * (1 + error * n_samples / horizon)

    A KL 20% above target for ``horizon`` samples multiplies beta by about e^0.2.

    >>> c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    >>> round(c.update(2.0, n_samples=10), 4)   # error clipped to 0.2: 0.1 * 1.02
    0.102
    """

    def __init__(self, coef: float, target: float, horizon: int):
        if coef <= 0:
            raise ValueError(f"coef ({coef}) must be > 0 for an adaptive controller")
        if target <= 0:
            raise ValueError(f"target ({target}) must be > 0")
        if horizon < 1:
            raise ValueError(f"horizon ({horizon}) must be >= 1")
        self.value = coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_samples: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon
        return self.value


def make_kl_controller(cfg) -> FixedKLController | AdaptiveKLController:
    """The controller ``algorithm.kl`` (a ``KLConfig``) names."""
    if cfg.controller == "adaptive":
        return AdaptiveKLController(cfg.coef, cfg.target, cfg.horizon)
    return FixedKLController(cfg.coef)
