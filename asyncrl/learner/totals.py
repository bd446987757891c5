"""The learner's running totals: samples and tokens trained, staleness, end-to-end latency.

``Counters`` are saved in each checkpoint (``asyncrl.learner.checkpoint_io``) so a resumed run's
totals continue (which samples are trained for the first time is told by group id, in
``asyncrl.learner.batch_requests``); ``Reservoir`` keeps the per-sample
latency of a run of any length in fixed memory. All of them end in the learner's ``final`` report.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.schema import Group


@dataclass
class Counters:
    """The learner's running totals; saved in checkpoints so a resumed run's totals continue."""

    trained: int = 0
    """Samples trained at least once."""
    trained_with_reuse: int = 0
    """Every time a sample was trained (a repeated hand-out counts, even once its every token is
    too stale: the sample was counted as dropped, ``stale``, at its first)."""
    trained_tokens: int = 0
    """Response tokens of every batch trained."""
    busy_s: float = 0.0
    """Seconds spent in ``train_step``."""
    staleness_hist: Counter = field(default_factory=Counter)
    """Samples trained, by staleness (learner version at the update - the version of the
    sample's oldest trained token)."""
    token_staleness_hist: Counter = field(default_factory=Counter)
    """Response tokens trained, by staleness of the version that sampled each."""
    segments_hist: Counter = field(default_factory=Counter)
    """Samples trained, by how many versions sampled them (1 unless an update came mid-answer)."""
    stale_tokens_masked: int = 0
    """Tokens kept as context only, their version past the staleness bound (``Sample.trained_from``)."""
    dropped: Counter = field(default_factory=Counter)
    """Samples not trained here, by reason (``duplicate``: a copy of a group already trained;
    ``stale``: every token past the staleness bound, the rest of its group trained)."""

    def add_step(self, groups: list[Group], stats: StepStats, first_time: int, dropped_stale: int = 0) -> None:
        """Count one learner step on ``groups``: ``stats`` is its ``train_step`` result,
        ``first_time`` how many of its samples were trained for the first time, ``dropped_stale``
        how many were handed out for the first time with no token left to train (dropped)."""
        self.busy_s += stats.step_s
        self.trained += first_time
        self.trained_with_reuse += sum(len(g.samples) for g in groups) - dropped_stale
        self.trained_tokens += sum(g.num_tokens for g in groups)
        self.stale_tokens_masked += stats.stale_tokens_masked
        for s in stats.staleness:
            self.staleness_hist[int(s)] += 1
        self.token_staleness_hist.update(stats.token_staleness)
        for g in groups:
            for s in g.samples:
                if not 0 < len(s.response_ids) <= s.trained_from:  # trained (some token in the loss)
                    self.segments_hist[len(s.version_segments or [None])] += 1


class Reservoir:
    """A uniform sample of at most ``size`` values of a stream (Vitter's algorithm R): percentiles
    over a run of any length in memory allocated once, so a long run's footprint never moves."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seen = size, 0
        self._kept = np.empty(size, dtype=np.float64)
        self._rng = np.random.default_rng(seed)

    @property
    def values(self) -> np.ndarray:
        return self._kept[: min(self.seen, self.size)]

    def extend(self, values) -> None:
        for v in values:
            if self.seen < self.size:
                self._kept[self.seen] = v
            elif (j := int(self._rng.integers(self.seen + 1))) < self.size:
                self._kept[j] = v
            self.seen += 1


def latency_summary(latencies) -> dict:
    """Mean and percentiles of the per-sample end-to-end latency (sampling start -> trained)."""
    if len(latencies) == 0:
        return {}
    arr = np.asarray(latencies)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95))}
