"""Samplers choose which stored groups form the learner's next batch, and say how likely each was.

A batch never holds one group twice. Every sampler returns, with the chosen slots, the
probability P(i) each had of being drawn and its importance weight, so a learner de-biases any of
them the same way (for uniform and FIFO the weights are 1).

- ``PrioritizedSampler`` (Schaul et al. 2016, "Prioritized Experience Replay", proportional
  variant): P(i) = p_i^α / Σ_k p_k^α, w_i = (N·P(i))^-β / max_j w_j = (min_j p_j^α / p_i^α)^β,
  β annealed linearly from ``beta`` to ``beta_final`` over ``beta_anneal_batches`` batches. It is
  the one owner of the priority structure (a ``SumTree`` over slots) and enforces the floor:
  p_i >= ``floor``, so P(i) >= floor^α / Σ_k p_k^α and every group stays reachable.
- ``UniformSampler``: the same tree with every leaf 1 (P(i) = 1/N, w_i = 1).
- ``FIFOSampler``: the k oldest arrivals (P = 1 for them, w = 1): plain streaming.

Drawing k distinct groups is successive sampling without replacement (``sumtree.sample_distinct``);
P(i) reported is the probability of the first draw, the quantity PER's weights are defined on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from asyncrl.buffer.storage import SlotStorage
from asyncrl.buffer.sumtree import SumTree, powered


@dataclass
class Draw:
    """What a sampler chose: (k,) slots, their P(i), their importance weights."""

    slots: np.ndarray
    probabilities: np.ndarray
    is_weights: np.ndarray


class PrioritizedSampler:
    """Proportional prioritized sampling over slots, with a priority floor and annealed β.

    >>> s = PrioritizedSampler(capacity=8, alpha=1.0, beta=1.0, floor=0.1)
    >>> s.add(np.array([0, 1]), np.array([3.0, 0.0]))  # the 0 is lifted to the floor, 0.1
    >>> d = s.sample(2, None)
    >>> sorted(np.round(d.probabilities, 3).tolist()), sorted(np.round(d.is_weights, 3).tolist())
    ([0.032, 0.968], [0.033, 1.0])
    """

    def __init__(
        self,
        capacity: int,
        alpha: float = 0.6,
        beta: float = 0.4,
        beta_final: float = 1.0,
        beta_anneal_batches: int = 1000,
        floor: float = 0.01,
        seed: int = 0,
        kernel: str = "auto",
    ):
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha ({alpha}) must be in [0, 1]")
        if not 0 <= beta <= beta_final <= 1:
            raise ValueError(f"beta ({beta}) and beta_final ({beta_final}) must satisfy 0 <= beta <= beta_final <= 1")
        if beta_anneal_batches < 1:
            raise ValueError(f"beta_anneal_batches ({beta_anneal_batches}) must be >= 1")
        if not floor > 0:
            raise ValueError(f"floor ({floor}) must be > 0: a zero priority would starve a group")
        self.alpha, self.beta0, self.beta_final = alpha, beta, beta_final
        self.beta_anneal_batches = beta_anneal_batches
        self.floor = floor
        self.tree = make_tree(capacity, kernel)
        self.rng = np.random.default_rng(seed)
        self.batches = 0

    @property
    def beta(self) -> float:
        """β now: beta + (beta_final - beta) · min(1, batches / beta_anneal_batches)."""
        frac = min(1.0, self.batches / self.beta_anneal_batches)
        return self.beta0 + (self.beta_final - self.beta0) * frac

    def add(self, slots: np.ndarray, priorities: np.ndarray, removed: np.ndarray | None = None) -> None:
        """Give new ``slots`` their priorities; also empty ``removed`` (slots just evicted to
        make room, distinct from ``slots``) in the same pass over the tree."""
        if removed is not None and removed.size:
            leaves = np.concatenate([np.zeros(removed.size), powered(priorities, self.floor, self.alpha)])
            self.tree.update(np.concatenate([removed, slots]), leaves)
        else:
            self.tree.update_powered(slots, priorities, self.floor, self.alpha)

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self.tree.update_powered(slots, priorities, self.floor, self.alpha)

    def remove(self, slots: np.ndarray) -> None:
        self.tree.update(slots, np.zeros(len(slots)))

    def scale(self, factor: float) -> None:
        """Multiply every priority by ``factor`` (recency decay), keeping the floor: O(capacity)."""
        leaves = self.tree.values()
        lifted = np.maximum(leaves * factor**self.alpha, self.floor**self.alpha)
        self.tree.set_all(np.where(leaves > 0, lifted, 0.0))

    def priorities(self, slots: np.ndarray) -> np.ndarray:
        """Current priorities p_i of ``slots`` (after the floor); needs α > 0."""
        return self.tree.values(slots) ** (1.0 / self.alpha) if self.alpha > 0 else np.ones(len(slots))

    def sample(self, k: int, storage: SlotStorage | None) -> Draw:
        """``k`` distinct slots (k <= stored items), with P(i) and w_i."""
        slots, probabilities, weights = self.tree.sample_prioritized(k, self.rng, self.beta)
        self.batches += 1
        return Draw(slots, probabilities, weights)

    def state(self) -> dict:
        return {"leaves": self.tree.values().copy(), "rng": self.rng.bit_generator.state, "batches": self.batches}

    def load_state(self, state: dict) -> None:
        self.tree.set_all(state["leaves"])
        self.rng.bit_generator.state = state["rng"]
        self.batches = int(state["batches"])


class UniformSampler(PrioritizedSampler):
    """Every stored group equally likely: P(i) = 1/N, w_i = 1 (priorities are ignored)."""

    def __init__(self, capacity: int, seed: int = 0, kernel: str = "auto"):
        super().__init__(capacity, alpha=0.0, beta=0.0, beta_final=0.0, floor=1.0, seed=seed, kernel=kernel)


class FIFOSampler:
    """The k oldest arrivals: P = 1 for each, w = 1. With use-once removal this is streaming."""

    batches = 0

    def add(self, slots: np.ndarray, priorities: np.ndarray, removed: np.ndarray | None = None) -> None:
        pass

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        pass

    def remove(self, slots: np.ndarray) -> None:
        pass

    def scale(self, factor: float) -> None:
        pass

    def sample(self, k: int, storage: SlotStorage) -> Draw:
        slots = storage.oldest(k)
        self.batches += 1
        return Draw(slots, np.ones(slots.size), np.ones(slots.size))

    def state(self) -> dict:
        return {"batches": self.batches}

    def load_state(self, state: dict) -> None:
        self.batches = int(state["batches"])


Sampler = PrioritizedSampler | UniformSampler | FIFOSampler

KERNELS = ("auto", "numba", "numpy")
_log = logging.getLogger(__name__)


def resolve_kernel(kernel: str) -> str:
    """``numba`` or ``numpy`` for ``BufferConfig.kernel``: ``auto`` is numba when it imports (else
    numpy, said once in the log); ``numba`` raises if it does not import."""
    global _numba_missing_logged
    if kernel not in KERNELS:
        raise ValueError(f"kernel ({kernel!r}) must be one of {KERNELS}")
    if kernel == "numpy":
        return kernel
    try:
        import asyncrl.buffer.compiled_tree  # noqa: F401  (numba, and vLLM's scan let through)
    except ImportError as e:
        if kernel == "numba":
            raise ImportError(f"kernel 'numba' needs the numba package, which does not import: {e}") from e
        if not _numba_missing_logged:
            _log.warning("buffer: numba does not import (%s); the sum tree runs in numpy, slower", e)
            _numba_missing_logged = True
        return "numpy"
    return "numba"


_numba_missing_logged = False


def make_tree(capacity: int, kernel: str = "auto") -> SumTree:
    """The sum tree of ``capacity`` leaves for ``kernel`` (``resolve_kernel``): ``SumTree``, or
    ``CompiledSumTree``, its batch operations compiled. Both draw the same leaves and weights."""
    if resolve_kernel(kernel) == "numpy":
        return SumTree(capacity)
    from asyncrl.buffer.compiled_tree import CompiledSumTree

    return CompiledSumTree(capacity)


def make_sampler(name: str, capacity: int, seed: int = 0, kernel: str = "auto", **prioritized) -> Sampler:
    """``prioritized`` (keyword arguments of ``PrioritizedSampler``), ``uniform`` or ``fifo``."""
    if name == "prioritized":
        return PrioritizedSampler(capacity, seed=seed, kernel=kernel, **prioritized)
    if name == "uniform":
        return UniformSampler(capacity, seed, kernel=kernel)
    if name == "fifo":
        return FIFOSampler()
    raise ValueError(f"sampler ({name!r}) must be one of 'prioritized', 'uniform', 'fifo'")
