"""Storage of whole groups by slot: metadata in numpy arrays, payloads beside them.

A group (the n samples of one prompt) is inserted, sampled and removed as one item, because a
group statistic (GRPO's mean and std of rewards) is meaningless for a partial group. Each stored
item occupies a *slot* in [0, max_items); everything the buffer decides on (sizes, versions, how
often sampled, arrival order) is a numpy array indexed by slot, so a batch of 256 items is a
handful of vectorised operations, never a Python loop over items.

An item's *key* names it for as long as it lives and never again: ``key = seq · max_items + slot``
where ``seq`` counts arrivals, so a learner's reply about a key whose slot has since been reused
is recognised (``slots_of``) without a dictionary.

Two payload kinds share the slot machinery:

- ``GroupStorage`` keeps ``wire.Group`` objects (the pipeline: groups arrive one at a time and
  are small);
- ``SlabStorage`` keeps fixed-width records in one numpy slab, one record per item, and gathers
  a batch with one ``np.take`` (the benchmark's trajectory path: moving bytes near memcpy speed).
"""

from __future__ import annotations

import numpy as np

from asyncrl.wire.schema import Group

_META = ("seq", "num_samples", "nbytes", "policy_version", "times_sampled", "inserted_at")


def group_nbytes(group: Group) -> int:
    """Bytes of the arrays a group holds: prompt ids plus each sample's response ids and logprobs."""
    return int(group.prompt_ids.nbytes + sum(s.response_ids.nbytes + s.logprobs.nbytes for s in group.samples))


class SlotStorage:
    """Slots, their metadata, free slots and arrival order, bounded in items, samples and bytes.

    ``item_size``: (samples, bytes) of every item when all items are alike (``SlabStorage``),
    else None; then sizes are counted, not summed, on the hot paths.

    >>> s = SlotStorage(max_items=4, capacity_samples=8, capacity_bytes=1 << 20)
    >>> slots = s.allocate(np.array([4, 4]), np.array([64, 64]), np.array([0, 1]), now=0.0)
    >>> s.oldest(1).tolist(), len(s), s.samples
    ([0], 2, 8)
    """

    item_size: tuple[int, int] | None = None

    def __init__(self, max_items: int, capacity_samples: int, capacity_bytes: int):
        for name, value in (
            ("capacity_samples", capacity_samples),
            ("capacity_bytes", capacity_bytes),
            ("max_items", max_items),
        ):
            if value < 1:
                raise ValueError(f"{name} ({value}) must be >= 1")
        self.max_items = max_items
        self.capacity_samples = capacity_samples
        self.capacity_bytes = capacity_bytes
        self.seq = np.full(max_items, -1, dtype=np.int64)  # arrival number of the item in a slot; -1: free
        self.num_samples = np.zeros(max_items, dtype=np.int64)
        self.nbytes = np.zeros(max_items, dtype=np.int64)
        self.policy_version = np.zeros(max_items, dtype=np.int64)
        self.times_sampled = np.zeros(max_items, dtype=np.int64)
        self.inserted_at = np.zeros(max_items, dtype=np.float64)  # wall-clock seconds
        self._free = np.arange(max_items - 1, -1, -1, dtype=np.int64)  # a stack: slot 0 on top
        self._num_free = max_items
        # Arrival order: (slot, seq) appended per insert; removed items are skipped lazily (their
        # seq no longer matches) and compacted away when the ring fills, so it stays <= 2x items.
        self._order_slot = np.zeros(2 * max_items, dtype=np.int64)
        self._order_seq = np.zeros(2 * max_items, dtype=np.int64)
        self._head = 0
        self._tail = 0
        self.next_seq = 0
        self.samples = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.max_items - self._num_free

    @property
    def num_free(self) -> int:
        return self._num_free

    # -- keys ----------------------------------------------------------------------------------

    def keys(self, slots: np.ndarray) -> np.ndarray:
        keys = self.seq.take(slots)
        keys *= self.max_items
        keys += slots
        return keys

    def mark_sampled(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """One more hand-out of each of ``slots`` (distinct) counted in ``times_sampled``;
        returns their keys, whether it was their first, and how many first there were."""
        keys = self.keys(slots)
        times = self.times_sampled.take(slots)
        first = times == 0
        times += 1
        self.times_sampled.put(slots, times)
        return keys, first, int(np.count_nonzero(first))

    def slots_of_counted(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """``slots_of`` with how many keys are valid."""
        slots, valid = self.slots_of(keys)
        return slots, valid, int(np.count_nonzero(valid))

    def slots_of(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """(slots, valid): ``valid`` is False for keys of items no longer stored."""
        seq, slots = np.divmod(np.asarray(keys, dtype=np.int64), self.max_items)
        valid = self.seq.take(slots) == seq
        if seq.size and seq.min() < 0:  # a negative key: its seq may be the -1 of a free slot
            valid &= seq >= 0
        return slots, valid

    def live_slots(self) -> np.ndarray:
        """Every occupied slot, ascending (O(max_items): for snapshots and sweeps, not hot paths)."""
        return np.flatnonzero(self.seq >= 0)

    # -- in and out ----------------------------------------------------------------------------

    def allocate(self, num_samples, nbytes, policy_version, now: float) -> np.ndarray:
        """Slots for len(policy_version) new items, in arrival order; raises if there is no room.

        ``num_samples`` and ``nbytes`` None: items of ``item_size``, whose sizes are preset.
        """
        if num_samples is None:
            k = len(policy_version)
            added_samples, added_bytes = k * self.item_size[0], k * self.item_size[1]
        else:
            num_samples = np.asarray(num_samples, dtype=np.int64)
            k = num_samples.size
            added_samples, added_bytes = int(num_samples.sum()), int(np.sum(nbytes))
        if k > self._num_free:
            raise ValueError(f"{k} items do not fit in {self._num_free} free slots: evict first")
        slots = self._free[self._num_free - k : self._num_free][::-1].copy()
        self._num_free -= k
        seqs = np.arange(self.next_seq, self.next_seq + k, dtype=np.int64)
        self.next_seq += k
        self.seq.put(slots, seqs)
        if num_samples is not None:
            self.num_samples[slots] = num_samples
            self.nbytes[slots] = nbytes
        self.policy_version[slots] = policy_version
        self.times_sampled.put(slots, 0)
        self.inserted_at.put(slots, now)
        self.samples += added_samples
        self.bytes += added_bytes
        if self._tail + k > self._order_slot.size:
            self._compact_order()
        self._order_slot[self._tail : self._tail + k] = slots
        self._order_seq[self._tail : self._tail + k] = seqs
        self._tail += k
        return slots

    def release(self, slots: np.ndarray) -> None:
        """Free ``slots`` (distinct, occupied)."""
        k = slots.size
        if self.item_size is None:
            self.samples -= int(self.num_samples[slots].sum())
            self.bytes -= int(self.nbytes[slots].sum())
        else:
            self.samples -= k * self.item_size[0]
            self.bytes -= k * self.item_size[1]
        self.seq.put(slots, -1)
        self._free[self._num_free : self._num_free + k] = slots
        self._num_free += k

    def oldest(self, k: int) -> np.ndarray:
        """Up to ``k`` occupied slots, oldest arrival first."""
        found: list[np.ndarray] = []
        need, pos = k, self._head
        while need > 0 and pos < self._tail:
            end = min(self._tail, pos + max(2 * need, 256))
            slots = self._order_slot[pos:end]
            alive = self.seq[slots] == self._order_seq[pos:end]
            if pos == self._head:  # skip the dead prefix for good
                self._head += int(np.argmax(alive)) if alive.any() else end - pos
            taken = slots[alive][:need]
            found.append(taken)
            need -= taken.size
            pos = end
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def _compact_order(self) -> None:
        slots = self._order_slot[self._head : self._tail]
        seqs = self._order_seq[self._head : self._tail]
        alive = self.seq[slots] == seqs
        n = int(alive.sum())
        self._order_slot[:n] = slots[alive]
        self._order_seq[:n] = seqs[alive]
        self._head, self._tail = 0, n

    # -- snapshots -----------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """Metadata of occupied slots in arrival order (free slots and the ring are rebuilt)."""
        slots = self.oldest(len(self))
        return {
            "slots": slots,
            **{name: getattr(self, name)[slots] for name in _META},
            "next_seq": np.array(self.next_seq),
        }

    def load_state(self, state: dict[str, np.ndarray]) -> np.ndarray:
        """Restore metadata into this (empty) storage; returns the restored slots in arrival order."""
        if len(self):
            raise ValueError(f"load_state needs an empty storage, this one holds {len(self)} items")
        slots = np.asarray(state["slots"], dtype=np.int64)
        if slots.size and (slots.max() >= self.max_items or slots.min() < 0):
            raise ValueError(f"snapshot slots reach {slots.max()}, beyond max_items ({self.max_items})")
        for name in _META:
            getattr(self, name)[slots] = state[name]
        occupied = np.zeros(self.max_items, dtype=bool)
        occupied[slots] = True
        free = np.flatnonzero(~occupied)[::-1]
        self._free[: free.size] = free
        self._num_free = free.size
        self._order_slot[: slots.size] = slots
        self._order_seq[: slots.size] = self.seq[slots]
        self._head, self._tail = 0, slots.size
        self.next_seq = int(state["next_seq"])
        self.samples = int(self.num_samples[slots].sum())
        self.bytes = int(self.nbytes[slots].sum())
        return slots


class GroupStorage(SlotStorage):
    """Slots holding ``wire.Group`` objects; refuses a second copy of a stored ``group_id``.

    >>> from tests.factories import make_group
    >>> s = GroupStorage(capacity_samples=16)
    >>> slot = s.add(make_group("g0"), now=0.0)
    >>> s.get(s.oldest(1))[0].group_id, "g0" in s
    ('g0', True)
    """

    def __init__(self, capacity_samples: int, capacity_bytes: int = 1 << 30, max_items: int | None = None):
        # Every group has >= 1 sample, so capacity_samples slots always suffice.
        super().__init__(max_items or capacity_samples, capacity_samples, capacity_bytes)
        self._groups: list[Group | None] = [None] * self.max_items
        self._slot_of: dict[str, int] = {}

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._slot_of

    def add(self, group: Group, now: float, policy_version: int | None = None) -> int:
        """Store one group (the caller made room); returns its slot. ``policy_version``: the
        version its staleness is measured from (None: the group's own)."""
        if group.group_id in self._slot_of:
            raise KeyError(f"group {group.group_id!r} is already stored")
        version = group.policy_version if policy_version is None else policy_version
        slot = int(self.allocate([len(group.samples)], [group_nbytes(group)], [version], now)[0])
        self._groups[slot] = group
        self._slot_of[group.group_id] = slot
        return slot

    def get(self, slots: np.ndarray) -> list[Group]:
        return [self._groups[s] for s in slots.tolist()]

    def release(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            del self._slot_of[self._groups[s].group_id]
            self._groups[s] = None
        super().release(slots)

    def payload_state(self, slots: np.ndarray) -> list[Group]:
        return self.get(slots)

    def load_payload(self, slots: np.ndarray, groups: list[Group]) -> None:
        for s, g in zip(slots.tolist(), groups):
            self._groups[s] = g
            self._slot_of[g.group_id] = s


class SlabStorage(SlotStorage):
    """Slots holding fixed-width records in one numpy slab (one record per item).

    A record packs every field of a trajectory side by side (e.g. 256 prompt ids, 1,024
    response ids, 1,024 logprobs: 9,216 bytes), so a batch is gathered by one ``np.take`` that
    copies whole records, ~0.9x the speed of a contiguous memcpy; one slab per field measured
    ~0.65x (three gathers of shorter rows). The batch's fields are views into the gathered records.

    >>> s = SlabStorage(4, {"tokens": ((3,), np.int32)})
    >>> slots = s.add_batch({"tokens": np.ones((2, 3), np.int32)}, np.array([0, 0]), now=0.0)
    >>> s.gather(slots)["tokens"].shape
    (2, 3)
    """

    def __init__(
        self, max_items: int, fields: dict[str, tuple[tuple[int, ...], type]], capacity_bytes: int | None = None
    ):
        self.record = np.dtype([(name, dtype, shape) for name, (shape, dtype) in fields.items()])
        row_bytes = max(1, self.record.itemsize)
        super().__init__(max_items, max_items, capacity_bytes or row_bytes * max_items)
        self.row_bytes = row_bytes
        self.item_size = (1, row_bytes)
        self.num_samples[:] = 1  # every slot's sizes, set once
        self.nbytes[:] = row_bytes
        self.slab = np.zeros(max_items, dtype=self.record)  # (max_items,) records

    def records(self, rows: dict[str, np.ndarray] | np.ndarray) -> np.ndarray:
        """(k,) records from a record array (as is) or a dict of (k, ...) field arrays (packed)."""
        if isinstance(rows, np.ndarray) and rows.dtype == self.record:
            return rows
        k = len(next(iter(rows.values()))) if rows else 0
        out = np.empty(k, dtype=self.record)
        for name in self.record.names or ():
            out[name] = rows[name]
        return out

    def add_batch(self, rows: dict[str, np.ndarray] | np.ndarray, policy_version: np.ndarray, now: float) -> np.ndarray:
        """Store k records (the caller made room); returns their slots."""
        slots = self.allocate(None, None, policy_version, now)
        if self.record.names:
            self.slab[slots] = self.records(rows)
        return slots

    def gather(self, slots: np.ndarray, out: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Fields of ``slots``' records, copied into ``out`` ((k,) records, preallocated) if given."""
        if not self.record.names:
            return {}
        if out is None:
            batch = np.take(self.slab, slots)
        else:
            # mode="clip": with the default "raise", numpy buffers `out` (3x slower); slots are valid.
            batch = np.take(self.slab, slots, out=out[: slots.size], mode="clip")
        return {name: batch[name] for name in self.record.names}

    def get(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        return self.gather(slots)

    def payload_state(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        return self.gather(slots)

    def load_payload(self, slots: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        if self.record.names:
            self.slab[slots] = self.records(rows)
