"""The rate limiter: when inserts and samples may proceed, with Reverb's semantics.

State: ``inserts``, ``samples`` and ``deletes`` counted in groups since the start (a snapshot
keeps them). With ``size = inserts - deletes`` and the ratio error

    diff = inserts · samples_per_insert - samples

(positive: samples lag behind the target ratio; negative: samples run ahead of it):

- a sample of n groups may proceed when ``size >= min_size_to_sample`` and
  ``diff - n >= min_diff`` (sampling moves diff down);
- an insert of n groups may proceed when ``size + n <= min_size_to_sample`` (filling up is
  free), or else ``diff + n · samples_per_insert <= max_diff`` (inserting moves diff up).

``SampleToInsertRatio(spi, min_size, error_buffer)`` sets
``min_diff, max_diff = spi · min_size ∓ error_buffer``: the offset ``spi · min_size`` is the diff
reached by filling up to ``min_size`` without sampling, so the band is centred on the state just
after the warm-up. ``MinSize(n)`` never blocks inserts and blocks samples only below n groups.
With spi = 1, min_size = B, error_buffer = B and a FIFO sampler that uses each group once, the
buffer is a bounded on-policy stream: at most 2B groups wait, each is trained exactly once.

Nothing here waits: the buffer service holds a blocked learner request until ``can_sample`` (or
its deadline), and stops reading its input socket while ``can_insert`` is false, so the reward
workers' sends block at their high-water mark and time out on their own clocks.
"""

from __future__ import annotations

import sys


class RateLimiter:
    """Reverb's rate limiter (``reverb/cc/rate_limiter.cc``), counting groups.

    >>> rl = RateLimiter.sample_to_insert_ratio(samples_per_insert=1.0, min_size_to_sample=2, error_buffer=2)
    >>> rl.insert(2); rl.can_sample(2), rl.can_insert(1)
    (True, True)
    >>> rl.insert(2); rl.can_insert(1)  # diff = 4 = max_diff: a fifth group would overshoot
    False
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float, max_diff: float):
        if not samples_per_insert > 0:
            raise ValueError(f"samples_per_insert ({samples_per_insert}) must be > 0")
        if min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be >= 1")
        if min_diff > max_diff:
            raise ValueError(f"min_diff ({min_diff}) must be <= max_diff ({max_diff})")
        self.samples_per_insert = samples_per_insert
        self.min_size_to_sample = min_size_to_sample
        self.min_diff = min_diff
        self.max_diff = max_diff
        self.inserts = 0
        self.samples = 0
        self.deletes = 0

    @classmethod
    def min_size(cls, min_size_to_sample: int) -> RateLimiter:
        """Block samples until ``min_size_to_sample`` groups are held; never block inserts."""
        return cls(1.0, min_size_to_sample, -sys.float_info.max, sys.float_info.max)

    @classmethod
    def sample_to_insert_ratio(
        cls, samples_per_insert: float, min_size_to_sample: int, error_buffer: float
    ) -> RateLimiter:
        """Hold samples/inserts near ``samples_per_insert`` within ± ``error_buffer`` groups."""
        if error_buffer < max(1.0, samples_per_insert):
            raise ValueError(
                f"error_buffer ({error_buffer}) must be >= max(1, samples_per_insert) = "
                f"{max(1.0, samples_per_insert)}, or inserts and samples can block each other forever"
            )
        offset = samples_per_insert * min_size_to_sample
        return cls(samples_per_insert, min_size_to_sample, offset - error_buffer, offset + error_buffer)

    @property
    def size(self) -> int:
        return self.inserts - self.deletes

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    def can_sample(self, n: int = 1) -> bool:
        if self.size < self.min_size_to_sample:
            return False
        return self.diff - n >= self.min_diff

    def can_insert(self, n: int = 1) -> bool:
        if self.size + n <= self.min_size_to_sample:
            return True
        return (self.inserts + n) * self.samples_per_insert - self.samples <= self.max_diff

    def insert(self, n: int = 1) -> None:
        self.inserts += n

    def sample(self, n: int = 1) -> None:
        self.samples += n

    def delete(self, n: int = 1) -> None:
        self.deletes += n

    def why_blocked(self) -> str:
        """The state in words, for the log line of a stalled side."""
        return (
            f"inserts={self.inserts} samples={self.samples} size={self.size} diff={self.diff:g} "
            f"(samples allowed while size >= {self.min_size_to_sample} and diff - n >= {self.min_diff:g}; "
            f"inserts while diff + spi <= {self.max_diff:g}, spi={self.samples_per_insert:g})"
        )

    def state(self) -> dict:
        return {
            "inserts": self.inserts,
            "samples": self.samples,
            "deletes": self.deletes,
            "samples_per_insert": self.samples_per_insert,
            "min_size_to_sample": self.min_size_to_sample,
            "min_diff": self.min_diff,
            "max_diff": self.max_diff,
        }

    def load_state(self, state: dict) -> None:
        for key in ("samples_per_insert", "min_size_to_sample", "min_diff", "max_diff"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"snapshot rate limiter {key} ({state[key]}) differs from this one's ({getattr(self, key)})"
                )
        self.inserts, self.samples, self.deletes = int(state["inserts"]), int(state["samples"]), int(state["deletes"])
