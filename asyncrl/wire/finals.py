"""The final reports: each role's last counters before its process exits, one declared type per role.

A process sends its report when it stops (``ProcessContext.emit`` adds ``peak_rss_bytes``); the
controller keeps the last one of each process (``asyncrl.controller.reports.ProcessReports``) and
reconciles them into the run's summary (``asyncrl.controller.accounting``), reading their fields as
attributes. Each type is an event of its own ``type`` tag (``<role>_final``); ``FinalReport`` is
their base, and ``FINALS`` maps a role to its type.
"""

from __future__ import annotations

from typing import ClassVar

from asyncrl.wire.message_base import Event


class FinalReport(Event, kw_only=True):
    """A process's last counters, before it exits (the base of each role's report)."""

    final: ClassVar[bool] = True
    peak_rss_bytes: int | None = None
    """Peak RSS of the process and its live descendants."""
    wall_s: float = 0.0
    """Seconds from the process's start of work to its stop."""


class BufferFinal(FinalReport, kw_only=True, tag="buffer_final"):
    """The replay buffer's accounting: inserted = sampled + Σ dropped + held (samples)."""

    inserted: int
    """Samples inserted."""
    sampled: int
    """Samples handed out for the first time."""
    resampled: int = 0
    """Hand-outs of samples handed out before (``buffer.max_times_sampled != 1``)."""
    dropped: dict[str, int] = {}
    """Samples dropped, by reason."""
    held: int = 0
    """Samples stored at the stop, never handed out."""
    held_groups: int = 0
    """Groups stored at the stop, never handed out."""
    removed: dict[str, int] = {}
    """Groups removed from storage, by reason (a remover's, or handed out for the last time)."""
    rejected_frames: int = 0
    """Frames refused by its sockets."""
    priority_updates_ignored: int = 0
    """Priority updates for groups no longer stored."""
    zero_variance: dict | None = None
    """The zero-variance filter's counts (``ZeroVarianceFilter.report``), when it is on."""


class DispatcherFinal(FinalReport, kw_only=True, tag="dispatcher_final"):
    """Prompts handed out, and where the dataset cursor stopped."""

    dispatched: int
    """Groups dispatched (prompts handed out, repeats included)."""
    epoch: int
    """The cursor's epoch."""
    index: int
    """The cursor's row within its epoch."""
    requeued: int = 0
    """Groups dispatched again after their generator or reward worker was lost."""
    passed_over: int = 0
    """Prompts passed over (too long for the engine)."""


class GeneratorFinal(FinalReport, kw_only=True, tag="generator_final"):
    """Samples generated and dropped, and the time spent sampling (a process of several loops
    sends one, the loops' counts summed: ``asyncrl.generators.multiplex``)."""

    generated: int
    """Samples generated."""
    tokens: int
    """Response tokens generated."""
    version: int
    """The policy version served at the stop (the lowest of its loops)."""
    dropped: dict[str, int] = {}
    """Samples dropped, by reason."""
    held: int = 0
    """Samples held at the stop (sent nowhere)."""
    busy_s: float = 0.0
    """Seconds spent sampling."""
    eval_prompts: int = 0
    """Held-out prompts answered."""
    eval_s: float = 0.0
    """Seconds spent answering them."""
    resumed: int = 0
    """Answers aborted at a weight update and resumed under the new version (``generator.partial_rollouts: resume``)."""


class RewardFinal(FinalReport, kw_only=True, tag="reward_final"):
    """Samples received, scored and passed on by a reward worker."""

    received: int
    """Samples received (handed-out ones excluded)."""
    forwarded: int
    """Samples sent on to the buffer, scored or unscored."""
    held: int = 0
    """Samples held at the stop."""
    handed_out: int = 0
    """Samples handed to hot-plugged workers."""
    requeued: int = 0
    """Groups scored again after a failure (``rewards.on_failure: retry``)."""
    unscored: int = 0
    """Samples sent on unscored (the buffer drops them with their reason)."""
    rejected_frames: int = 0
    """Frames refused by its sockets."""


class LearnerFinal(FinalReport, kw_only=True, tag="learner_final"):
    """What the learner trained; rank 0's report carries the counts, another rank's only its
    rank, version and wall time."""

    rank: int = 0
    """The learner's rank (``learner.ranks``)."""
    version: int
    """The learner's version at the stop."""
    trained: int = 0
    """Samples trained at least once."""
    trained_with_reuse: int = 0
    """Samples trained, every repeated hand-out counted."""
    trained_tokens: int = 0
    """Response tokens of every batch trained."""
    held: int = 0
    """Samples of batches that came after the last step."""
    dropped: dict[str, int] = {}
    """Samples not trained, by reason (``duplicate``, ``stale``)."""
    busy_s: float = 0.0
    """Seconds spent in ``train_step``."""
    staleness_hist: dict[str, int] = {}
    """Samples trained, by staleness of their oldest trained token."""
    token_staleness_hist: dict[str, int] = {}
    """Response tokens trained, by staleness of the version that sampled each."""
    segments_hist: dict[str, int] = {}
    """Samples trained, by the number of versions that sampled them (their ``version_segments``)."""
    stale_tokens_masked: int = 0
    """Tokens kept as context only, past the staleness bound (``Sample.trained_from``)."""
    latency_s: dict[str, float] = {}
    """Percentiles of the seconds from a sample's start of sampling to the end of its training."""


class ReferenceFinal(FinalReport, kw_only=True, tag="reference_final"):
    """Requests the reference process served."""

    served: int
    """Rows of reference logprobs served: one per sequence, or per packed row of several
    (``learner.trainer.micro_batch_tokens``)."""


FINALS: dict[str, type[FinalReport]] = {
    "buffer": BufferFinal,
    "dispatcher": DispatcherFinal,
    "generator": GeneratorFinal,
    "reward": RewardFinal,
    "learner": LearnerFinal,
    "reference": ReferenceFinal,
}
"""Role -> the type of its final report."""
