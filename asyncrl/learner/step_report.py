"""What the learner reports of each step: Prometheus metrics and the ``step`` event.

The metrics are recorded as soon as a step is trained; the ``step`` event, which the controller
prints in part and keeps whole, goes out at the end of the step (after its publication and
checkpoint, if any) with the trainer's ``StepStats`` and the batch's accuracy, size and wait, and,
when the batch holds multi-turn episodes, their figures (``episode_figures``): computed here from
the groups rather than in the trainer, so the simulated trainer reports them too; a batch of single-turn
answers costs one pass over its samples and reports none (None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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
    from asyncrl.wire.schema import Group


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
    for name, value in episode_figures(groups).items():
        setattr(stats, name, value)
    ctx.emit(StepEvent(stats=stats))


def episode_figures(groups: list[Group]) -> dict:
    """The batch's multi-turn figures, ``StepStats`` field -> value (their docstrings say what
    each is); {} when no sample is an episode's.

    An episode is its samples with one ``Episode.id`` (several parts when its context was edited):
    its turns, tool calls, errors and tokens are its parts' sums, and the environment failed it
    when it failed a part. ``episode_masked_frac``'s denominator is every response token of the
    batch, so a mix of episodes and single-turn answers reads as the share it is.
    """
    episodes: dict[str, list[int]] = {}  # id -> [turns, tool calls, tool errors, tokens, masked, failed]
    tokens = 0
    for group in groups:
        for sample in group.samples:
            tokens += len(sample.response_ids)
            e = sample.episode
            if e is None:
                continue
            figures = episodes.setdefault(e.id, [0] * 6)
            figures[0] += e.turns
            figures[1] += e.tool_calls
            figures[2] += e.tool_errors
            figures[3] += len(sample.response_ids)
            figures[4] += int(len(e.loss_mask) - np.count_nonzero(e.loss_mask))
            figures[5] |= e.env_error is not None
    if not episodes:
        return {}
    turns, calls, errors, length, masked, failed = np.asarray(list(episodes.values()), dtype=np.float64).mean(axis=0)
    return {
        "episodes": len(episodes),
        "episode_turns": float(turns),
        "episode_tool_calls": float(calls),
        "episode_tool_errors": float(errors),
        "episode_tokens": float(length),
        "episode_masked_tokens": float(masked),
        "episode_masked_frac": float(masked * len(episodes) / max(tokens, 1)),
        "episode_env_failed": float(failed),
    }
