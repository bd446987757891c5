"""Removers decide which stored groups leave the buffer without being asked for; the buffer
removes what they select and counts it by their reason.

- ``FIFOEviction`` (reason ``evicted``): past the capacity in items, samples or bytes, the
  oldest arrivals make room for a new one. The buffer never grows.
- ``MaxTimesSampled`` (reason ``max_times_sampled``): a group sampled ``max_times`` times is
  retired (1 = use once, the on-policy default).
- ``StalenessGate`` (reason ``stale``): with the learner at version v, a group sampled by
  ``policy_version < v - max_staleness`` can no longer be trained within the bound. Groups are
  bucketed by version when they arrive, so advancing the learner version costs O(expired groups),
  not a sweep of the whole buffer; entries of groups that left otherwise are purged when the
  buckets reach twice the slots, so they stay bounded even if the version never moves.
"""

from __future__ import annotations

import numpy as np

from asyncrl.buffer.storage import SlotStorage


class FIFOEviction:
    """Oldest-first eviction until an incoming batch fits.

    >>> s = SlotStorage(max_items=2, capacity_samples=8, capacity_bytes=100)
    >>> _ = s.allocate(np.array([4, 4]), np.array([10, 10]), np.array([0, 0]), now=0.0)
    >>> FIFOEviction().select(s, items=1, samples=4, nbytes=10).tolist()
    [0]
    """

    reason = "evicted"

    def select(self, storage: SlotStorage, items: int, samples: int, nbytes: int) -> np.ndarray:
        over_items = items - storage.num_free
        over_samples = storage.samples + samples - storage.capacity_samples
        over_bytes = storage.bytes + nbytes - storage.capacity_bytes
        if over_items <= 0 and over_samples <= 0 and over_bytes <= 0:
            return np.zeros(0, dtype=np.int64)
        if storage.item_size is not None:  # items alike: how many must go is a division
            per_samples, per_bytes = storage.item_size
            return storage.oldest(max(over_items, -(-over_samples // per_samples), -(-over_bytes // per_bytes), 1))
        m = max(over_items, items, 1)
        oldest = storage.oldest(m)
        # The common case: the fewest items that make room in items also do in samples and bytes
        # (two sums instead of two running sums; the same answer, the shortest such prefix).
        first = oldest[: max(over_items, 1)]
        if (
            first.size == max(over_items, 1)
            and storage.num_samples[first].sum() >= over_samples
            and storage.nbytes[first].sum() >= over_bytes
        ):
            return first
        while True:
            enough = (
                (np.arange(1, oldest.size + 1) >= over_items)
                & (np.cumsum(storage.num_samples[oldest]) >= over_samples)
                & (np.cumsum(storage.nbytes[oldest]) >= over_bytes)
            )
            if enough.any():
                return oldest[: int(np.argmax(enough)) + 1]
            if oldest.size < m:  # everything goes, and it is still not enough: the caller checks sizes
                return oldest
            m *= 2
            oldest = storage.oldest(m)


class MaxTimesSampled:
    """Retire groups once sampled ``max_times`` times."""

    reason = "max_times_sampled"

    def __init__(self, max_times: int):
        if max_times < 1:
            raise ValueError(f"max_times_sampled ({max_times}) must be >= 1")
        self.max_times = max_times

    def select(self, storage: SlotStorage, slots: np.ndarray) -> np.ndarray:
        """Of the just-sampled ``slots``, those that reached the limit."""
        return slots[storage.times_sampled[slots] >= self.max_times]


class StalenessGate:
    """Drop groups older than ``max_staleness`` versions behind the learner.

    >>> s = SlotStorage(max_items=4, capacity_samples=8, capacity_bytes=100)
    >>> gate = StalenessGate(max_staleness=1)
    >>> slots = s.allocate(np.array([1, 1]), np.array([1, 1]), np.array([0, 2]), now=0.0)
    >>> gate.on_insert(s, slots, np.array([0, 2]))
    >>> gate.select(s, learner_version=2).tolist()  # version 0 is 2 behind: stale
    [0]
    """

    reason = "stale"

    def __init__(self, max_staleness: int | None):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness ({max_staleness}) must be >= 0 or None")
        self.max_staleness = max_staleness
        self._buckets: dict[int, list[np.ndarray]] = {}  # policy_version -> slots that arrived with it
        self._entries = 0

    def set_bound(self, max_staleness: int) -> None:
        """A new bound while running (``buffer.max_staleness: auto``): groups are bucketed by
        version whatever the bound, so it applies from the next ``select``."""
        if self.max_staleness is None or max_staleness < 0:
            raise ValueError(
                f"max_staleness ({max_staleness}) must be >= 0, set on a gate built with a bound "
                f"(this one: {self.max_staleness})"
            )
        self.max_staleness = max_staleness

    def is_stale(self, policy_version, learner_version: int) -> np.ndarray:
        if self.max_staleness is None:
            return np.zeros(np.shape(policy_version), dtype=bool)
        return learner_version - np.asarray(policy_version) > self.max_staleness

    def on_insert(self, storage: SlotStorage, slots: np.ndarray, policy_versions: np.ndarray) -> None:
        if self.max_staleness is None:
            return
        self._entries += slots.size
        if self._entries > 2 * storage.max_items:
            self.rebuild(storage)  # purges entries of groups already gone; includes ``slots``
            return
        self._add(slots, np.asarray(policy_versions))

    def _add(self, slots: np.ndarray, versions: np.ndarray) -> None:
        if versions.size and versions.min() == versions.max():
            self._buckets.setdefault(int(versions[0]), []).append(slots)
            return
        for v in np.unique(versions).tolist():
            self._buckets.setdefault(v, []).append(slots[versions == v])

    def select(self, storage: SlotStorage, learner_version: int) -> np.ndarray:
        """Stale stored slots; their buckets are forgotten."""
        if self.max_staleness is None:
            return np.zeros(0, dtype=np.int64)
        cutoff = learner_version - self.max_staleness  # versions below it are stale
        expired = [v for v in self._buckets if v < cutoff]
        if not expired:
            return np.zeros(0, dtype=np.int64)
        popped = [s for v in expired for s in self._buckets.pop(v)]
        self._entries -= sum(a.size for a in popped)
        slots = np.unique(np.concatenate(popped))
        # A bucket entry outlives its item: keep slots still occupied by a stale item (a slot
        # reused by a newer item has a newer version, or is listed in its own bucket).
        occupied = storage.seq[slots] >= 0
        return slots[occupied & (storage.policy_version[slots] < cutoff)]

    def rebuild(self, storage: SlotStorage) -> None:
        """Re-bucket every stored group (after a restore)."""
        self._buckets.clear()
        slots = storage.live_slots()
        self._entries = slots.size
        if self.max_staleness is not None:
            self._add(slots, storage.policy_version[slots])
