"""The replay buffer's logic, free of sockets: insert, gate, sample, count.

Parts composed in one constructor (storage × sampler × staleness gate), so later parts
(priorities, rate limiter, snapshots) slot in without touching the service loop.

Every group that enters ends in exactly one counter: ``sampled`` (handed to the learner),
``dropped[reason]``, or still ``held`` (``len(storage)``); ``reconcile()`` checks it.

Staleness gate: when the learner at version v asks for a batch, groups with
``v - policy_version > max_staleness`` can no longer be trained within the bound and are dropped
with reason ``stale``. Unscored groups are dropped with the reason the reward worker gave.
"""

from __future__ import annotations

from collections import Counter

from pydantic import Field

from asyncrl.buffer.samplers import make_sampler
from asyncrl.buffer.storage import GroupStorage
from asyncrl.configbase import Config
from asyncrl.wire import Group


class BufferConfig(Config):
    capacity_samples: int = Field(4096, ge=1)
    """Samples the buffer holds at most; past it the buffer stops reading (backpressure), it never grows."""
    sampler: str = "fifo"
    """Which stored groups a batch takes: ``fifo`` (oldest first, use once) or ``uniform``."""
    max_staleness: int | None = Field(4, ge=0)
    """Drop groups more than this many versions behind the learner at sampling time; None keeps all."""
    seed: int = 0
    """Seed of the sampler's random draws."""


class ReplayBuffer:
    """Groups in, batches out, every group accounted for.

    >>> buf = ReplayBuffer(BufferConfig(capacity_samples=64))
    >>> buf.sample(4, learner_version=0)
    []
    """

    def __init__(self, cfg: BufferConfig):
        self.cfg = cfg
        self.storage = GroupStorage(cfg.capacity_samples)
        self.sampler = make_sampler(cfg.sampler, cfg.seed)
        self.inserted = Counter()  # "groups", "samples"
        self.sampled = Counter()
        self.dropped: Counter[str] = Counter()  # reason -> samples
        self.dropped_groups = 0

    def has_room(self, num_samples: int) -> bool:
        return self.storage.has_room_for(num_samples)

    def insert(self, group: Group) -> None:
        """Store a scored group; an unscored one is dropped with the reason its reward gave."""
        self.inserted["groups"] += 1
        self.inserted["samples"] += len(group.samples)
        if not group.scored:
            self._drop(group, group.meta.get("unscored_reason", "reward_failed"))
            return
        self.storage.insert(group)

    def sample(self, num_groups: int, learner_version: int) -> list[Group]:
        """Up to ``num_groups`` groups for a learner at ``learner_version``, removed from storage."""
        self._drop_stale(learner_version)
        ids, _probs = self.sampler.select(self.storage, num_groups)
        groups = [self.storage.remove(i) for i in ids]
        self.sampled["groups"] += len(groups)
        self.sampled["samples"] += sum(len(g.samples) for g in groups)
        return groups

    def ready(self, num_groups: int, learner_version: int) -> bool:
        self._drop_stale(learner_version)
        return len(self.storage) >= num_groups

    def _drop_stale(self, learner_version: int) -> None:
        if self.cfg.max_staleness is None:
            return
        for gid in self.storage.ids():
            if learner_version - self.storage.get(gid).policy_version > self.cfg.max_staleness:
                self._drop(self.storage.remove(gid), "stale")

    def _drop(self, group: Group, reason: str) -> None:
        self.dropped[reason] += len(group.samples)
        self.dropped_groups += 1

    def reconcile(self) -> dict:
        """Samples in = sampled + dropped + held; raises if a sample went missing."""
        held = self.storage.num_samples
        out = {
            "inserted": self.inserted["samples"],
            "sampled": self.sampled["samples"],
            "dropped": dict(self.dropped),
            "held": held,
            "held_groups": len(self.storage),
        }
        if out["inserted"] != out["sampled"] + sum(self.dropped.values()) + held:
            raise AssertionError(f"buffer accounting does not reconcile: {out}")
        return out
