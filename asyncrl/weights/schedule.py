"""When the learner publishes a new version: every K steps, every T seconds, or on staleness.

The learner's version is its step count (one per batch, whatever the optimizer updates in it). Generators serve at most the last published
version p, so a sample they start now is stamped ≤ p and will be trained at a learner version
≥ v + 1. The buffer admits it while ``staleness = version_at_update − p ≤ S``
(``buffer.max_staleness``). The staleness schedule therefore publishes after step v when

    v + 1 − p > S − margin

i.e. just before the oldest sample that could still be in flight would exceed the bound;
``margin`` (``weights.staleness_margin``) leaves room for samples already sampled but not yet
trained. With no bound (S None) it falls back to every K steps. The final step is always published.
Under ``buffer.max_staleness: auto`` the learner moves S after each step (``set_max_staleness``).
"""

from __future__ import annotations

import time

from asyncrl.weights.config import WeightSyncConfig


class BroadcastSchedule:
    """``due(version)`` after each optimizer step; ``published(version)`` after each publication.

    >>> s = BroadcastSchedule(WeightSyncConfig(schedule="staleness", staleness_margin=1), every_k=2, max_staleness=4, total_steps=100)
    >>> [v for v in range(1, 10) if s.due(v) and s.published(v) is None]
    [3, 6, 9]
    """

    def __init__(
        self, cfg: WeightSyncConfig, every_k: int, max_staleness: int | None, total_steps: int, clock=time.monotonic
    ):
        if every_k < 1:
            raise ValueError(f"every_k ({every_k}) must be >= 1")
        self.cfg = cfg
        self.every_k = every_k
        self.set_max_staleness(max_staleness)
        self.total_steps = total_steps
        self.clock = clock
        self.last_version = 0  # generators start from the learner's initial weights
        self.last_time = clock()

    def set_max_staleness(self, max_staleness: int | None) -> None:
        """The bound S to publish by (moved by the learner under ``buffer.max_staleness: auto``)."""
        if (
            max_staleness is not None
            and self.cfg.schedule == "staleness"
            and max_staleness - self.cfg.staleness_margin < 1
        ):
            raise ValueError(
                f"buffer.max_staleness ({max_staleness}) minus weights.staleness_margin "
                f"({self.cfg.staleness_margin}) must be >= 1"
            )
        self.max_staleness = max_staleness

    def due(self, version: int) -> bool:
        if version <= self.last_version:
            return False
        if version >= self.total_steps:
            return True
        if self.cfg.schedule == "every_s":
            return self.clock() - self.last_time >= self.cfg.every_s
        if self.cfg.schedule == "staleness" and self.max_staleness is not None:
            return version + 1 - self.last_version > self.max_staleness - self.cfg.staleness_margin
        return version % self.every_k == 0

    def published(self, version: int) -> None:
        self.last_version = version
        self.last_time = self.clock()
