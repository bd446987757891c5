import numpy as np
import pytest

from asyncrl.buffer.removers import FIFOEviction, MaxTimesSampled, StalenessGate
from asyncrl.buffer.storage import SlotStorage


def test_fifo_eviction_frees_enough_samples_and_bytes_oldest_first():
    s = SlotStorage(max_items=10, capacity_samples=10, capacity_bytes=100)
    slots = s.allocate(np.array([4, 4, 2]), np.array([10, 10, 10]), np.zeros(3), now=0.0)
    evict = FIFOEviction()
    assert evict.select(s, items=1, samples=0, nbytes=70).size == 0  # fits: 100 bytes
    assert evict.select(s, items=1, samples=3, nbytes=10).tolist() == slots[:1].tolist()  # 13 > 10 samples
    assert evict.select(s, items=1, samples=5, nbytes=10).tolist() == slots[:2].tolist()  # needs 5: 4 + 4
    assert evict.select(s, items=1, samples=1, nbytes=85).tolist() == slots[:2].tolist()  # 115 > 100 bytes


def test_max_times_sampled_selects_groups_at_their_limit():
    s = SlotStorage(max_items=4, capacity_samples=4, capacity_bytes=100)
    slots = s.allocate(np.ones(3, dtype=np.int64), np.ones(3), np.zeros(3), now=0.0)
    s.times_sampled[slots] = [1, 2, 3]
    assert MaxTimesSampled(2).select(s, slots).tolist() == slots[1:].tolist()


def test_staleness_gate_drops_by_version_and_its_buckets_stay_bounded():
    s = SlotStorage(max_items=4, capacity_samples=4, capacity_bytes=100)
    gate = StalenessGate(max_staleness=1)
    versions = np.array([0, 1, 2])
    slots = s.allocate(np.ones(3, dtype=np.int64), np.ones(3), versions, now=0.0)
    gate.on_insert(s, slots, versions)
    assert gate.select(s, learner_version=2).tolist() == slots[:1].tolist()  # 2 - 0 > 1
    assert gate.select(s, learner_version=2).size == 0  # the bucket is gone
    assert gate.is_stale(np.array([0, 1]), 2).tolist() == [True, False]
    # a version that never advances: entries of groups that left are purged, not accumulated
    for _ in range(100):
        s.release(slots)
        slots = s.allocate(np.ones(3, dtype=np.int64), np.ones(3), versions + 5, now=0.0)
        gate.on_insert(s, slots, versions + 5)
    assert gate._entries <= 2 * s.max_items
    assert StalenessGate(None).select(s, 10**6).size == 0


def test_a_gate_bound_set_while_running_applies_from_the_next_select():
    s = SlotStorage(max_items=4, capacity_samples=4, capacity_bytes=100)
    gate = StalenessGate(max_staleness=4)
    versions = np.array([0, 1, 2])
    slots = s.allocate(np.ones(3, dtype=np.int64), np.ones(3), versions, now=0.0)
    gate.on_insert(s, slots, versions)
    assert gate.select(s, learner_version=3).size == 0
    gate.set_bound(1)  # lowered: versions 0 and 1 are now more than 1 behind 3
    assert gate.select(s, learner_version=3).tolist() == slots[:2].tolist()
    with pytest.raises(ValueError, match="set on a gate built with a bound"):
        StalenessGate(None).set_bound(2)
