"""Samplers choose which stored groups form the learner's next batch.

A sampler only chooses; the buffer removes what was chosen (use-once) and applies the staleness
gate before asking. ``FIFOSampler`` is plain streaming (oldest first); ``UniformSampler`` draws
without replacement. Both return the probability each chosen group had, so a learner that
de-biases a non-uniform sampler (the prioritized one) gets the same interface.
"""

from __future__ import annotations

import numpy as np

from asyncrl.buffer.storage import GroupStorage


class FIFOSampler:
    """Oldest groups first: P(i) = 1 for the k oldest, 0 otherwise."""

    def select(self, storage: GroupStorage, k: int) -> tuple[list[str], np.ndarray]:
        ids = storage.ids()[:k]
        return ids, np.ones(len(ids))


class UniformSampler:
    """k groups drawn uniformly without replacement: P(i) = k / N."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def select(self, storage: GroupStorage, k: int) -> tuple[list[str], np.ndarray]:
        ids = storage.ids()
        k = min(k, len(ids))
        chosen = self.rng.choice(len(ids), size=k, replace=False)
        return [ids[i] for i in chosen], np.full(k, k / max(len(ids), 1))


def make_sampler(name: str, seed: int = 0) -> FIFOSampler | UniformSampler:
    if name == "fifo":
        return FIFOSampler()
    if name == "uniform":
        return UniformSampler(seed)
    raise ValueError(f"sampler ({name!r}) must be one of 'fifo', 'uniform'")
