"""The replay buffer's logic, free of sockets: parts composed in one constructor.

``ReplayBuffer(storage, sampler, priority, rate_limiter, max_times_sampled, max_staleness)``:

- storage (``GroupStorage`` for the pipeline, ``SlabStorage`` for fixed-width trajectories)
  holds whole groups by slot, bounded in items, samples and bytes;
- the priority function (``GroupPriority``) scores a group once, when it arrives;
- the sampler (prioritized, uniform or FIFO) chooses batches and owns the only priority
  structure; the learner may update priorities after a step (``update_priorities``);
- removers: FIFO eviction past capacity, ``max_times_sampled``, and the staleness gate driven
  by the learner version fed in with ``set_learner_version``;
- the rate limiter says whether inserts and samples may proceed (the service holds what may not).

Ledger. Every sample that arrives ends in exactly one counter, each sample counted once however
often it is trained: ``sampled`` (handed out at least once; later hand-outs count in
``resampled``), ``dropped[reason]`` (left without ever being handed out: ``stale``, ``evicted``,
the reward failure, ``duplicate``, ``too_large``, ``truncated`` when ``drop_truncated`` refuses
groups holding an answer cut off at the length limit, ``zero_variance`` when the
``zero_variance`` filter refuses groups whose answers all score alike), or ``held`` (stored,
never handed out yet):

    inserted = sampled + Σ dropped + held

A group already trained that is later evicted or retired is not a drop; removals of every kind
are reported separately, by reason, to the ``observer`` (the service's metrics).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.priorities import GroupPriority
from asyncrl.buffer.ratelimiter import RateLimiter
from asyncrl.buffer.removers import FIFOEviction, MaxTimesSampled, StalenessGate
from asyncrl.buffer.samplers import Sampler, make_sampler, resolve_kernel
from asyncrl.buffer.snapshot import restore_buffer, save_buffer
from asyncrl.buffer.stale_segments import gate_version
from asyncrl.buffer.storage import GroupStorage, SlotStorage, group_nbytes
from asyncrl.buffer.zero_variance import ZeroVarianceFilter
from asyncrl.wire.schema import Group

__all__ = ["BufferConfig", "ReplayBuffer", "SampledBatch"]


@dataclass
class SampledBatch:
    """A batch: (k,) keys, the items (groups, or field -> (k, ...) arrays), P(i), IS weights, and
    whether it is each item's first hand-out."""

    keys: np.ndarray
    items: list[Group] | dict[str, np.ndarray]
    probabilities: np.ndarray
    is_weights: np.ndarray
    first_time: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def __len__(self) -> int:
        return len(self.keys)


def check_priorities(priorities, n: int) -> np.ndarray:
    """``priorities`` as a (n,) float64 array; raises unless there are n, all finite and >= 0."""
    p = np.asarray(priorities, dtype=np.float64).reshape(-1)
    if p.size != n:
        raise ValueError(f"{p.size} priorities given for {n} items; there must be one per item")
    if p.size and not (p.min() >= 0 and p.max() < np.inf):  # two reductions; NaN fails the first
        bad = ~(np.isfinite(p) & (p >= 0))
        raise ValueError(f"priorities ({p[bad][:3].tolist()}) must be finite and >= 0")
    return p


class ReplayBuffer:
    """Groups in, prioritized batches out, every sample accounted for.

    >>> from tests.factories import make_group
    >>> buf = ReplayBuffer.from_config(BufferConfig(capacity_samples=64))
    >>> buf.insert(make_group("g0", rewards=[1.0, 0.0, 1.0, 0.0]))
    0
    >>> [g.group_id for g in buf.sample(4).items]
    ['g0']
    """

    def __init__(
        self,
        storage: SlotStorage,
        sampler: Sampler,
        priority: GroupPriority | None = None,
        rate_limiter: RateLimiter | None = None,
        max_times_sampled: int | None = 1,
        max_staleness: int | None = None,
        observer=None,
        clock=time.time,
        drop_truncated: bool = False,
        zero_variance: ZeroVarianceFilter | None = None,
        partial_rollouts: str = "off",
        kernel: str = "auto",
    ):
        self.storage = storage
        # The hand-out's and the priority update's slot bookkeeping, compiled or numpy (``buffer.kernel``).
        if resolve_kernel(kernel) == "numba":
            from asyncrl.buffer.compiled_slots import mark_sampled, slots_of
        else:
            mark_sampled, slots_of = type(storage).mark_sampled, type(storage).slots_of_counted
        self._mark_sampled, self._slots_of = mark_sampled, slots_of
        self.sampler = sampler
        self.priority = priority or GroupPriority()
        self.rate_limiter = rate_limiter or RateLimiter.min_size(1)
        self.eviction = FIFOEviction()
        self.reuse_limit = MaxTimesSampled(max_times_sampled) if max_times_sampled is not None else None
        self.staleness = StalenessGate(max_staleness)
        # on_insert(priorities), on_sample(age_versions, age_s, samples), on_remove(reason, samples)
        self.observer = observer
        self.clock = clock
        self.drop_truncated = drop_truncated
        """Drop on arrival a group with a sample whose finish_reason is ``length`` (``algorithm.truncation.mode: drop``)."""
        self.zero_variance = zero_variance
        """Drop on arrival, last of all checks, a group whose answers all score alike (``buffer.zero_variance``)."""
        self.partial_rollouts = partial_rollouts
        """``generator.partial_rollouts``: unless ``off``, the staleness gate measures a group from
        its newest segment and its stale segments are masked instead (``asyncrl.buffer.stale_segments``)."""
        self.learner_version = 0
        self.inserted = Counter()  # "groups", "samples": every arrival, stored or not
        self.sampled = Counter()  # first hand-outs
        self.resampled = Counter()  # later hand-outs
        self.dropped: Counter[str] = Counter()  # reason -> samples never handed out
        self.dropped_groups = 0
        self.removed: Counter[str] = Counter()  # reason -> samples, every removal
        self.priority_updates_ignored = 0

    @classmethod
    def from_config(
        cls,
        cfg: BufferConfig,
        storage: SlotStorage | None = None,
        observer=None,
        drop_truncated: bool = False,
        partial_rollouts: str = "off",
    ) -> ReplayBuffer:
        if storage is None:
            storage = GroupStorage(cfg.capacity_samples, cfg.capacity_bytes)
        sampler = make_sampler(
            cfg.sampler,
            storage.max_items,
            cfg.seed,
            kernel=cfg.kernel,
            alpha=cfg.alpha,
            beta=cfg.beta,
            beta_final=cfg.beta_final,
            beta_anneal_batches=cfg.beta_anneal_batches,
            floor=cfg.priority_floor,
        )
        if cfg.samples_per_insert is None:
            limiter = RateLimiter.min_size(cfg.min_size_to_sample)
        else:
            limiter = RateLimiter.sample_to_insert_ratio(
                cfg.samples_per_insert, cfg.min_size_to_sample, cfg.error_buffer
            )
        return cls(
            storage,
            sampler,
            GroupPriority(cfg.priority, cfg.recency_decay),
            limiter,
            cfg.max_times_sampled,
            cfg.initial_staleness,
            observer,
            drop_truncated=drop_truncated,
            zero_variance=ZeroVarianceFilter.from_config(cfg.zero_variance),
            partial_rollouts=partial_rollouts,
            kernel=cfg.kernel,
        )

    def __len__(self) -> int:
        return len(self.storage)

    # -- in -------------------------------------------------------------------------------------

    def insert(self, group: Group) -> int | None:
        """Store a scored group and return its key; or drop it, counted by reason, and return None."""
        n = len(group.samples)
        self.inserted["groups"] += 1
        self.inserted["samples"] += n
        nbytes = group_nbytes(group)
        version = gate_version(group, self.partial_rollouts)  # what its staleness is measured from
        if not group.scored:
            reason = group.unscored_reason or "reward_failed"
        elif group.group_id in self.storage:
            reason = "duplicate"  # at-least-once delivery upstream: the first copy stands
        elif n > self.storage.capacity_samples or nbytes > self.storage.capacity_bytes:
            reason = "too_large"
        elif self.drop_truncated and any(s.finish_reason == "length" for s in group.samples):
            reason = "truncated"
        elif self.staleness.is_stale(version, self.learner_version):
            reason = "stale"
        elif self.zero_variance is not None and self.zero_variance.filters(group):
            reason = ZeroVarianceFilter.reason
        else:
            reason = None
        if reason is not None:
            self._drop_unstored(n, reason, group.group_id)
            return None
        rewards = [[s.reward for s in group.samples]]
        priorities = check_priorities(self.priority(rewards, [version], self.learner_version), 1)
        evicted = self._make_room(1, n, nbytes)
        slots = np.array([self.storage.add(group, self.clock(), version)], dtype=np.int64)
        self._stored(slots, np.array([version]), priorities, evicted)
        return int(self.storage.keys(slots)[0])

    def insert_batch(
        self, rows: dict[str, np.ndarray] | np.ndarray, policy_version: np.ndarray, priorities: np.ndarray
    ) -> np.ndarray:
        """Store k one-sample items in a ``SlabStorage`` ((k,) records, or fields -> (k, ...)
        arrays); returns their keys.

        The benchmark's path: priorities given, not computed from rewards.
        """
        k = len(policy_version)
        if k > self.storage.max_items:
            raise ValueError(f"a batch of {k} items exceeds the buffer's capacity ({self.storage.max_items} items)")
        priorities = check_priorities(priorities, k)
        self.inserted["groups"] += k
        self.inserted["samples"] += k
        evicted = self._make_room(k, k, k * self.storage.row_bytes)
        slots = self.storage.add_batch(rows, policy_version, self.clock())
        self._stored(slots, policy_version, priorities, evicted)
        return self.storage.keys(slots)

    def _make_room(self, items: int, samples: int, nbytes: int) -> np.ndarray:
        """Evict the oldest groups until the newcomers fit; their priorities are emptied later,
        in the same tree pass that writes the newcomers' (``_stored``), which is one pass of
        three per step saved at full capacity."""
        evict = self.eviction.select(self.storage, items, samples, nbytes)
        if evict.size:
            self._remove(evict, FIFOEviction.reason, empty_priorities=False)
        return evict

    def _stored(self, slots: np.ndarray, versions: np.ndarray, priorities: np.ndarray, evicted: np.ndarray) -> None:
        # Evicted slots the newcomers did not take over still hold their old priority. Released
        # slots go on top of the free stack, where the newcomers' are taken from: with no more
        # evicted than arrived, the newcomers took them all.
        removed = evicted[self.storage.seq[evicted] < 0] if evicted.size > slots.size else evicted[:0]
        self.sampler.add(slots, priorities, removed=removed)
        self.staleness.on_insert(self.storage, slots, versions)
        self.rate_limiter.insert(slots.size)
        if self.observer is not None:
            self.observer.on_insert(priorities)

    # -- out ------------------------------------------------------------------------------------

    def can_insert(self, n: int = 1) -> bool:
        return self.rate_limiter.can_insert(n)

    def can_sample(self, k: int) -> bool:
        """Whether a batch of ``k`` groups can be handed out now (size and rate limiter)."""
        return len(self.storage) >= k and self.rate_limiter.can_sample(k)

    def sample(self, k: int, out: np.ndarray | None = None) -> SampledBatch:
        """Up to ``k`` distinct groups; callers check ``can_sample`` first (the service does).

        ``out``: a preallocated (k,) record array a ``SlabStorage`` gathers the batch into.
        """
        st = self.storage
        k = min(k, len(st))
        if k == 0:
            return SampledBatch(np.zeros(0, dtype=np.int64), [], np.zeros(0), np.zeros(0))
        draw = self.sampler.sample(k, st)
        slots = draw.slots
        keys, first, first_groups = self._mark_sampled(st, slots)
        ns = None
        if st.item_size is not None:  # items alike: counts, not sums
            all_samples, first_samples = k * st.item_size[0], first_groups * st.item_size[0]
        else:
            ns = st.num_samples.take(slots)
            all_samples = int(ns.sum())
            if first_groups in (0, k):
                first_samples = all_samples if first_groups else 0
            else:
                first_samples = int(ns[first].sum())
        self.sampled["groups"] += first_groups
        self.sampled["samples"] += first_samples
        self.resampled["groups"] += k - first_groups
        self.resampled["samples"] += all_samples - first_samples
        items = st.get(slots) if out is None else st.gather(slots, out)
        self.rate_limiter.sample(k)
        if self.observer is not None:
            self.observer.on_sample(
                self.learner_version - st.policy_version[slots],
                self.clock() - st.inserted_at[slots],
                st.num_samples.take(slots) if ns is None else ns,
            )
        if self.reuse_limit is not None:
            done = self.reuse_limit.select(st, slots)
            if done.size:
                self._remove(done, MaxTimesSampled.reason)
        return SampledBatch(keys, items, draw.probabilities, draw.is_weights, first)

    def update_priorities(self, keys, priorities) -> int:
        """Set new priorities (the learner's, after a step) of the groups still stored; returns
        how many applied. Keys of groups already gone are ignored and counted."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        p = check_priorities(priorities, keys.size)
        slots, valid, applied = self._slots_of(self.storage, keys)
        if applied < keys.size:
            self.priority_updates_ignored += keys.size - applied
            slots, p = slots[valid], p[valid]
        if slots.size:
            if self.priority.recency_decay != 1:  # (decay^age is 1 otherwise)
                p = p * self.priority.decay(self.learner_version - self.storage.policy_version[slots])
            self.sampler.update(slots, p)
        return int(slots.size)

    def set_learner_version(self, version: int) -> None:
        """The learner reached ``version``: drop what became stale, age priorities (recency)."""
        if version <= self.learner_version:
            return
        delta = version - self.learner_version
        self.learner_version = version
        stale = self.staleness.select(self.storage, version)
        if stale.size:
            self._remove(stale, StalenessGate.reason)
        if self.priority.recency_decay < 1:
            self.sampler.scale(self.priority.recency_decay**delta)

    # -- accounting -----------------------------------------------------------------------------

    def _drop_unstored(self, samples: int, reason: str, group_id: str) -> None:
        self.dropped[reason] += samples
        if reason != "duplicate":  # a copy never held a slot of the dispatcher's budget
            self.dropped_groups += 1
        self.removed[reason] += samples
        if self.observer is not None:
            self.observer.on_remove(reason, samples)
            self._report_dropped([group_id], reason)

    def _report_dropped(self, group_ids: list[str], reason: str) -> None:
        # Optional observer hook: the service writes these to the group ledger.
        hook = getattr(self.observer, "on_drop_groups", None)
        if hook is not None and group_ids:
            hook(group_ids, reason)

    def _remove(self, slots: np.ndarray, reason: str, empty_priorities: bool = True) -> None:
        st = self.storage
        fresh = st.times_sampled.take(slots) == 0
        fresh_groups = int(np.count_nonzero(fresh))
        if st.item_size is not None:  # items alike: counts, not sums
            total, fresh_samples = slots.size * st.item_size[0], fresh_groups * st.item_size[0]
        else:
            ns = st.num_samples[slots]
            total = int(ns.sum())
            fresh_samples = int(ns[fresh].sum()) if fresh_groups else 0
        self.removed[reason] += total
        if fresh_groups:
            self.dropped[reason] += fresh_samples
            self.dropped_groups += fresh_groups
            if self.observer is not None and hasattr(st, "_slot_of"):  # groups with ids (not slab rows)
                self._report_dropped([g.group_id for g in st.get(slots[fresh])], reason)
        if empty_priorities:
            self.sampler.remove(slots)
        st.release(slots)
        self.rate_limiter.delete(slots.size)
        if self.observer is not None:
            self.observer.on_remove(reason, total)

    def reconcile(self) -> dict:
        """inserted = sampled + Σ dropped + held (samples); raises if a sample went missing."""
        live = self.storage.live_slots()
        fresh = live[self.storage.times_sampled[live] == 0]
        out = {
            "inserted": self.inserted["samples"],
            "sampled": self.sampled["samples"],
            "resampled": self.resampled["samples"],
            "dropped": dict(self.dropped),
            "held": int(self.storage.num_samples[fresh].sum()),
            "held_groups": int(fresh.size),
        }
        if out["inserted"] != out["sampled"] + sum(self.dropped.values()) + out["held"]:
            raise AssertionError(f"buffer accounting does not reconcile: {out}")
        return out

    def held_group_ids(self) -> list[str]:
        """Ids of the stored groups never handed out (group storage only)."""
        live = self.storage.live_slots()
        fresh = live[self.storage.times_sampled[live] == 0]
        return [g.group_id for g in self.storage.get(fresh)] if hasattr(self.storage, "_slot_of") else []

    def stored_group_ids(self) -> list[str]:
        """Ids of every stored group (group storage only)."""
        return (
            [g.group_id for g in self.storage.get(self.storage.live_slots())]
            if hasattr(self.storage, "_slot_of")
            else []
        )

    # -- snapshots ------------------------------------------------------------------------------

    def snapshot(self, path) -> None:
        """Write the whole state (items, priorities, counters, rate limiter, RNG) to a new
        directory, atomically (``asyncrl.buffer.snapshot``)."""
        save_buffer(self, path)

    def restore(self, path) -> None:
        """Load a snapshot into this fresh buffer, built with the same config; the next samples
        are then those the snapshotted buffer would have drawn."""
        restore_buffer(self, path)
