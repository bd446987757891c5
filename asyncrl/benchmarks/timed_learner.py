"""A learner that trains in simulated time, with the pipeline's staleness rule, for ``vllm_modes``.

``TimedLearner`` starts at the version the engine serves and takes finished groups (``Rollout``) first in, first out, and each step trains
``batch_groups`` of them in ``s_per_token`` seconds per response token (a sleep: on a cluster the
learner has its own devices, and on this machine it must not take the engine's CPU), then
publishes the next version. The rule is the pipeline's (``docs/concepts/staleness.md``):

- **Admission** (AReaL's, the dispatcher's): the ``j``-th group may start under version ``v``
  (the engine's; steps counted from the start) while ``j < (v + η + 1) · batch_groups``, so no group is ever more than η steps behind when
  trained. η = 0 is the synchronous pipeline: a batch is generated with the weights it is
  trained at, and the next only once they changed.
- **Staleness** is the learner's version at the step minus the *oldest* version that sampled
  the group (its first segment); a group past η when its turn comes is dropped (counted), as the
  buffer's gate drops it.

Every figure is per step (``steps``): when it ended, the response tokens and samples trained, the
staleness of each sample, tokens by the staleness of the version that sampled each, and how
many versions sampled each sample.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class Rollout:
    """One finished group, as the learner sees it."""

    index: int
    """The group's place in the workload (its admission number)."""
    tokens: int
    """Response tokens of its n samples."""
    samples: int
    """n."""
    segments: list[list[list[int]]]
    """Per sample, ``[[first_token_index, version], ...]`` (one segment unless a swap came mid-answer)."""
    lengths: list[int] = field(default_factory=list)
    """Per sample, response tokens."""

    @property
    def oldest(self) -> int:
        return min(seg[1] for segs in self.segments for seg in segs)


class TimedLearner:
    """Train ``batch_groups`` groups a step in simulated time until ``total_steps``; thread-safe ``put``.

    >>> learner = TimedLearner(batch_groups=1, max_staleness=0, s_per_token=0.0, total_steps=1)
    >>> learner.admits(0), learner.admits(1)
    (True, False)
    >>> learner.put(Rollout(0, tokens=4, samples=2, segments=[[[0, 0]], [[0, 0]]], lengths=[2, 2]))
    >>> learner.run(); learner.version, learner.steps[0]["tokens"]
    (1, 4)
    """

    def __init__(
        self,
        batch_groups: int,
        max_staleness: int,
        s_per_token: float,
        total_steps: int,
        wait_s: float = 600.0,
        version: int = 0,
        sleep=time.sleep,
        clock=time.monotonic,
    ):
        if batch_groups < 1 or max_staleness < 0 or s_per_token < 0 or total_steps < 1:
            raise ValueError(
                f"batch_groups ({batch_groups}) >= 1, max_staleness ({max_staleness}) >= 0, "
                f"s_per_token ({s_per_token}) >= 0 and total_steps ({total_steps}) >= 1"
            )
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        self.s_per_token, self.total_steps, self.wait_s = s_per_token, total_steps, wait_s
        self.sleep, self.clock = sleep, clock
        self.start = self.version = version
        """Version of the weights last published (``start`` + steps done)."""
        self.steps: list[dict] = []
        self.dropped_stale = 0
        """Groups past η when their turn came."""
        self.busy_s = 0.0
        self._ready: deque[Rollout] = deque()
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.done = threading.Event()

    def admits(self, index: int, served: int | None = None) -> bool:
        """May the ``index``-th group start now, sampled by version ``served`` (None: the latest)?
        The admission rule in the module docstring, computed from the version the engine serves,
        as the dispatcher computes it from the one in the generator's request: a group must not
        start under older weights than its place allows."""
        version = self.version if served is None else min(served, self.version)
        return index < (version - self.start + self.max_staleness + 1) * self.batch_groups

    def put(self, rollout: Rollout) -> None:
        with self._cond:
            self._ready.append(rollout)
            self._cond.notify()

    def _take(self) -> list[Rollout]:
        """The next batch: the first ``batch_groups`` groups within η, the staler ones dropped."""
        deadline = self.clock() + self.wait_s
        with self._cond:
            while True:
                while self._ready and self.version - self._ready[0].oldest > self.max_staleness:
                    self._ready.popleft()
                    self.dropped_stale += 1
                fresh = [r for r in self._ready if self.version - r.oldest <= self.max_staleness]
                if len(fresh) >= self.batch_groups:
                    batch = fresh[: self.batch_groups]
                    for r in batch:
                        self._ready.remove(r)
                    return batch
                left = deadline - self.clock()
                if left <= 0:
                    raise TimeoutError(
                        f"learner at version {self.version}: waited {self.wait_s:g} s for {self.batch_groups} "
                        f"groups within staleness {self.max_staleness}, has {len(fresh)}"
                    )
                self._cond.wait(min(left, 1.0))

    def run(self) -> None:
        """Train until ``total_steps`` (run in a thread; an error is kept in ``error``)."""
        try:
            while len(self.steps) < self.total_steps:
                batch = self._take()
                tokens = sum(r.tokens for r in batch)
                step_s = self.s_per_token * tokens
                self.sleep(step_s)
                self.busy_s += step_s
                staleness, token_staleness, versions = [], Counter(), Counter()
                for r in batch:
                    for segs, length in zip(r.segments, r.lengths or [None] * len(r.segments)):
                        staleness.append(self.version - segs[0][1])
                        versions[len(segs)] += 1
                        ends = [s[0] for s in segs[1:]] + [length if length is not None else segs[-1][0]]
                        for (start, v), end in zip(segs, ends):
                            token_staleness[self.version - v] += end - start
                with self._cond:
                    self.version += 1
                self.steps.append(
                    {
                        "t": self.clock(),
                        "tokens": tokens,
                        "samples": sum(r.samples for r in batch),
                        "staleness": staleness,
                        "token_staleness": dict(token_staleness),
                        "versions_per_sample": dict(versions),
                    }
                )
        except BaseException as e:  # handed to the driver, which raises it
            self.error = e
        finally:
            self.done.set()
