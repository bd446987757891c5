"""Declarations of on-policy distillation's config (``algorithm.distill``, ``DistillConfig``).
Kept apart from ``config.py`` (one job: what distillation declares); like it, importing this
imports no torch.
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.configbase import Config


class DistillConfig(Config):
    """On-policy distillation: each sampled token's advantage gains coef * (log pi_T - log mu), the
    teacher's log-probability (a ``teacher`` reward, ``asyncrl.rewards.teacher``) less the
    behaviour policy's; formula and references in ``asyncrl.learner.distill``."""

    coef: float = Field(1.0, gt=0)
    """Weight of the per-token reverse-KL advantage (log pi_T(y_t) - log mu(y_t)) added to each token's advantage."""
    rewards: bool = True
    """Add it to the advantages of ``adv_estimator`` from the rewards (distillation and RL), or use it alone (false: pure on-policy distillation, the rewards only reported)."""
    clip: float | None = Field(None, gt=0)
    """Clip each token's distillation advantage to [-clip, clip] (a token the teacher finds near-impossible otherwise weighs -log pi_T); None: off, as the references."""
    baseline: bool = False
    """Subtract the batch's mean log-ratio over its trained tokens from each token's (a constant baseline: the expected gradient is unchanged, its variance lower); false: none, as the references."""
