"""What the learner reports of each step: Prometheus metrics and the ``step`` event.

The metrics are recorded as soon as a step is trained; the ``step`` event, which the controller
prints in part and keeps whole, goes out at the end of the step (after its publication and
checkpoint, if any) with the trainer's ``StepStats`` and the batch's accuracy, size and wait.
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
from asyncrl.wire.messages import StepEvent

if TYPE_CHECKING:
    from asyncrl.learner.batch_requests import Batch
    from asyncrl.learner.context import LearnerContext
    from asyncrl.observability.step_stats import StepStats


def record_step_metrics(version: int, batch: Batch, stats: StepStats) -> None:
    """The step's Prometheus metrics: busy and step seconds, the version, samples, staleness."""
    BUSY_SECONDS.inc(stats.step_s)
    LEARNER_STEP_SECONDS.observe(stats.step_s)
    POLICY_VERSION.set(version)
    record_learner_step(stats)
    SAMPLES.labels("trained").inc(sum(len(g.samples) for g in batch.groups))
    for s in stats.staleness:
        STALENESS.observe(s)
    if stats.stale_tokens_masked:  # partial rollouts: tokens too stale kept as context only
        PARTIAL_ROLLOUTS.labels("stale_tokens_masked").inc(stats.stale_tokens_masked)
        PARTIAL_ROLLOUTS.labels("stale_samples_dropped").inc(stats.stale_samples_masked)


def report_step(ctx: LearnerContext, batch: Batch, stats: StepStats) -> None:
    """The ``step`` event of the step that produced ``stats.version``: its stats with the batch's
    accuracy, samples and wait."""
    groups = batch.groups
    stats.accuracy = batch_accuracy(groups)
    stats.samples = sum(len(g.samples) for g in groups)
    stats.wait_s = batch.wait_s
    ctx.emit(StepEvent(stats=stats))
