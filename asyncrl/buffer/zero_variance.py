"""Zero-variance groups: DAPO's dynamic sampling, as a filter at the buffer's door.

A group-relative advantage (GRPO, Dr. GRPO, RLOO, OPO, pass@k, REINFORCE++ with the group
baseline) is each answer's reward less a statistic of its group's rewards. When every answer of a
group scores alike those advantages are all 0: the group adds no policy gradient, only a share of
the batch that then carries less signal. DAPO (Yu et al. 2025, "dynamic sampling") samples on
until the batch is full of groups with 0 < accuracy < 1; verl's ``algorithm.filter_groups`` keeps
the groups whose score has std > 0 and generates further batches to fill the train batch.

Here a group whose rewards are alike is dropped when it reaches the buffer, reason
``zero_variance``, through the buffer's one drop path: counted in its ledger
(``dropped["zero_variance"]``, samples), written to the group ledger, exported as
``asyncrl_dropped{reason="zero_variance"}``, and reported by id in the buffer's status, from
which the dispatcher frees the group's slot of the staleness budget and hands a new prompt out in
its place (the refill; its rule is in ``asyncrl.dispatcher.admission``). The learner's batches are
thus always full of groups with a signal, and generation never stops to refill a batch: there is
no counterpart of verl's ``max_num_gen_batches``.

Alike means: population standard deviation of the group's rewards ≤ ``tolerance``; at the
default 0, every reward exactly equal (verl's ``std > 0`` keeps the rest). Differences from verl:

- which score: ``reward`` None is the combined reward (verl's ``metric: score``); a reward's name
  is that reward's part of each sample (``Sample.reward_parts``; ``exact_match`` is verl's
  ``acc``). A group lacking that part in some sample is kept and counted (``unmeasured``);
- a tolerance above 0 also drops near-ties (a reward model's scores), whose std-normalised
  advantages would mostly scale noise up;
- a one-sample group is kept, as in verl: it has no spread to measure.

The rewards looked at are those the reward workers gave, before the learner's shaping (the
overlong penalty of ``algorithm.truncation.mode: penalise``, a KL penalty in the reward): a group
alike in them can differ after it, by length or KL alone, which DAPO does not count as a signal
(verl's recipe filters on ``acc`` for the same reason).

Counts: the groups dropped by the reward they all had (``by_reward``, 4 significant digits, at
most ``MAX_REWARD_LABELS`` values, the rest under ``other``). With 0/1 rewards, ``"1"`` counts
prompts every answer solved (too easy) and ``"0"`` prompts none did (too hard): the task mix's
health, as PRIME-RL's solve-all and solve-none rates. They travel in the buffer's snapshot
(``state``/``load_state``), so a resumed run counts on from its checkpoint.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.observability import metrics as m

if TYPE_CHECKING:
    from asyncrl.buffer.config import ZeroVarianceConfig
    from asyncrl.wire.schema import Group

log = logging.getLogger(__name__)

ZERO_VARIANCE = "zero_variance"
"""The drop reason, in the buffer's ledger, the group ledger and ``asyncrl_dropped``."""
MAX_REWARD_LABELS = 8
"""Distinct shared rewards counted apart (label values of ``asyncrl_zero_variance_groups``);
further ones count as ``other``, so a continuous reward cannot grow the metric without bound."""


class ZeroVarianceFilter:
    """Says whether a scored group's answers all score alike, and counts those it says so of.

    >>> f = ZeroVarianceFilter()
    >>> from tests.factories import make_group
    >>> f.filters(make_group("g0", rewards=[1.0, 1.0, 1.0, 1.0]))
    True
    >>> f.filters(make_group("g1", rewards=[1.0, 0.0, 1.0, 1.0]))
    False
    >>> f.report()
    {'groups': 1, 'samples': 4, 'by_reward': {'1': 1}, 'unmeasured': 0}
    """

    reason = ZERO_VARIANCE

    def __init__(self, tolerance: float = 0.0, reward: str | None = None):
        if not tolerance >= 0:
            raise ValueError(f"tolerance ({tolerance}) must be >= 0")
        self.tolerance = float(tolerance)
        self.reward = reward
        self.groups = 0
        self.samples = 0
        self.by_reward: Counter[str] = Counter()
        self.unmeasured = 0
        """Groups kept because some sample lacks the ``reward`` part the filter looks at."""

    @classmethod
    def from_config(cls, cfg: ZeroVarianceConfig) -> ZeroVarianceFilter | None:
        """The filter ``cfg`` asks for; None when it is off."""
        return cls(cfg.tolerance, cfg.reward) if cfg.drop else None

    def filters(self, group: Group) -> bool:
        """True if ``group`` (scored) is to be dropped as zero-variance; then it is counted."""
        values = self._scores(group)
        if values is None or len(values) < 2:
            return False
        if self.tolerance == 0:
            alike = max(values) == min(values)  # exact: a float std can round a real spread to 0
        else:
            alike = float(np.std(values)) <= self.tolerance
        if alike:
            self._count(values[0], len(group.samples))
        return alike

    def _scores(self, group: Group) -> list[float] | None:
        if self.reward is None:
            return [s.reward for s in group.samples]
        values = [s.reward_parts.get(self.reward) for s in group.samples]
        if any(v is None for v in values):
            if not self.unmeasured:
                log.warning(
                    "buffer: group %s has no %r reward in some sample: kept unfiltered; further such groups are "
                    "only counted (zero_variance.unmeasured)",
                    group.group_id,
                    self.reward,
                )
            self.unmeasured += 1
            return None
        return values

    def _count(self, reward: float, samples: int) -> None:
        label = f"{reward:.4g}"
        if label not in self.by_reward and len(self.by_reward) >= MAX_REWARD_LABELS:
            label = "other"
        self.groups += 1
        self.samples += samples
        self.by_reward[label] += 1
        m.ZERO_VARIANCE_GROUPS.labels(label).inc()

    def report(self) -> dict:
        """The counts, for the buffer's final report and ``summary.json``."""
        return {
            "groups": self.groups,
            "samples": self.samples,
            "by_reward": dict(self.by_reward),
            "unmeasured": self.unmeasured,
        }

    def state(self) -> dict:
        """What a snapshot keeps (``asyncrl.buffer.snapshot``)."""
        return self.report()

    def load_state(self, state: dict) -> None:
        """Continue from a snapshot's counts; the metric counts on from them too (as the restored
        ``asyncrl_dropped`` does)."""
        self.groups, self.samples = int(state["groups"]), int(state["samples"])
        self.by_reward = Counter({k: int(v) for k, v in state["by_reward"].items()})
        self.unmeasured = int(state.get("unmeasured", 0))
        for label, n in self.by_reward.items():
            m.ZERO_VARIANCE_GROUPS.labels(label).inc(n)
