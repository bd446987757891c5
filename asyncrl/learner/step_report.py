"""What the learner reports of each step: Prometheus metrics and the ``step`` event.

The metrics are recorded as soon as a step is trained; the ``step`` event, which the controller
prints in part and keeps whole, goes out at the end of the step (after its publication and
checkpoint, if any) with the batch's reward, accuracy, size, wait and the trainer's stats named
in ``STEP_EVENT_STATS``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.observability.metrics import (
    BUSY_SECONDS,
    LEARNER_STEP_SECONDS,
    PARTIAL_ROLLOUTS,
    POLICY_VERSION,
    SAMPLES,
    STALENESS,
    record_learner_step,
)
from asyncrl.tasks.answers import batch_accuracy

if TYPE_CHECKING:
    from asyncrl.learner.batch_requests import Batch
    from asyncrl.learner.context import LearnerContext

STEP_EVENT_STATS = (
    "clipfrac",
    "clipfrac_high",
    "clipfrac_low",
    "clipfrac_dual",
    "ppo_kl",
    "is_weight_mean",
    "is_weight_max",
    "is_weight_ess",
    "masked_frac",
    "behaviour_kl",
    "mismatch_kl",
    "entropy",
    "ref_kl",
    "kl_coef",
    "grad_norm",
    "grad_norm_max",
    "grad_clipped",
    "grad_clip_coef",
    "lr",
    "updates",
    "approx_kl",
    "clipfrac_by_epoch",
    "approx_kl_by_epoch",
    "value_loss",
    "truncated_frac",
    "overlong_penalty",
    "padding_frac",
    "outside_truncation_frac",
    "behaviour_ess",
    "behaviour_kl_by_staleness",
    "staleness_bound",
    "staleness_bound_reason",
)
"""Trainer stats that ride along in each "step" event (the controller prints some, keeps all)."""


def record_step_metrics(version: int, batch: Batch, stats: dict) -> None:
    """The step's Prometheus metrics: busy and step seconds, the version, samples, staleness."""
    BUSY_SECONDS.inc(stats["seconds"])
    LEARNER_STEP_SECONDS.observe(stats["seconds"])
    POLICY_VERSION.set(version)
    record_learner_step(stats)
    SAMPLES.labels("trained").inc(sum(len(g.samples) for g in batch.groups))
    for s in stats["staleness"]:
        STALENESS.observe(s)
    if stats.get("stale_tokens_masked"):  # partial rollouts: tokens too stale kept as context only
        PARTIAL_ROLLOUTS.labels("stale_tokens_masked").inc(stats["stale_tokens_masked"])
        PARTIAL_ROLLOUTS.labels("stale_samples_dropped").inc(stats.get("stale_samples_masked", 0))


def report_step(ctx: LearnerContext, version: int, batch: Batch, stats: dict) -> None:
    """The ``step`` event of the step that produced ``version``."""
    groups = batch.groups
    rewards = [s.reward for g in groups for s in g.samples]
    ctx.emit(
        "step",
        version=version,
        loss=stats["loss"],
        reward=sum(rewards) / len(rewards),
        accuracy=batch_accuracy(groups),
        tokens=sum(g.num_tokens for g in groups),
        samples=sum(len(g.samples) for g in groups),
        wait_s=batch.wait_s,
        step_s=stats["seconds"],
        staleness_mean=stats["staleness_mean"],
        staleness_max=stats["staleness_max"],
        **{k: v for k, v in stats.items() if k in STEP_EVENT_STATS},
    )
