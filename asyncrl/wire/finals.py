"""The final reports: a process's last counters before it exits."""

from __future__ import annotations

from asyncrl.wire.message_base import Event


class FinalEvent(Event, kw_only=True, tag="final"):
    """A process's last counters, before it exits; each role sends its own (the controller's
    accounting, ``asyncrl.controller.accounting``, reconciles them)."""

    peak_rss_bytes: int | None = None
    """Peak RSS of the process and its live descendants."""
    rank: int | None = None
    """The learner's rank (``learner.ranks``): rank 0's report carries the learner's counts."""
    # shared by several roles
    version: int | None = None
    held: int | None = None
    dropped: dict[str, int] | None = None
    requeued: int | None = None
    rejected_frames: int | None = None
    busy_s: float | None = None
    wall_s: float | None = None
    # buffer
    inserted: int | None = None
    sampled: int | None = None
    resampled: int | None = None
    held_groups: int | None = None
    removed: dict[str, int] | None = None
    priority_updates_ignored: int | None = None
    zero_variance: dict | None = None
    """The zero-variance filter's counts (``ZeroVarianceFilter.report``), when it is on."""
    # dispatcher
    dispatched: int | None = None
    epoch: int | None = None
    index: int | None = None
    passed_over: int | None = None
    # generator
    generated: int | None = None
    tokens: int | None = None
    eval_prompts: int | None = None
    eval_s: float | None = None
    resumed: int | None = None
    """Answers aborted at a weight update and resumed under the new version (``generator.partial_rollouts: resume``)."""
    # learner
    trained: int | None = None
    trained_with_reuse: int | None = None
    staleness_hist: dict[str, int] | None = None
    token_staleness_hist: dict[str, int] | None = None
    """Response tokens trained, by staleness of the version that sampled each."""
    segments_hist: dict[str, int] | None = None
    """Samples trained, by the number of versions that sampled them (their ``version_segments``)."""
    stale_tokens_masked: int | None = None
    """Tokens kept as context only, past the staleness bound (``Sample.trained_from``)."""
    latency_s: dict[str, float] | None = None
    trained_tokens: int | None = None
    # reward worker
    received: int | None = None
    forwarded: int | None = None
    handed_out: int | None = None
    unscored: int | None = None
    # reference process
    served: int | None = None
