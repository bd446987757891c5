import numpy as np
import pytest

from asyncrl.buffer.storage import GroupStorage, SlabStorage, SlotStorage, group_nbytes
from tests.factories import make_group


def ones(k):
    return np.ones(k, dtype=np.int64)


def test_keys_name_an_item_for_its_lifetime_only():
    s = SlotStorage(max_items=2, capacity_samples=2, capacity_bytes=100)
    first = s.allocate(ones(1), ones(1), [0], now=0.0)
    key = s.keys(first)
    assert s.slots_of(key)[1].tolist() == [True]
    s.release(first)
    again = s.allocate(ones(1), ones(1), [0], now=0.0)  # the same slot, a new item
    assert again.tolist() == first.tolist()
    slots, valid = s.slots_of(np.concatenate([key, s.keys(again), [-1]]))
    assert valid.tolist() == [False, True, False]


def test_oldest_follows_arrival_order_through_removals_and_compaction():
    s = SlotStorage(max_items=4, capacity_samples=4, capacity_bytes=100)
    order = []
    for i in range(40):  # 10x the ring's turnover: compaction must keep order
        if len(s) == 4:
            oldest = s.oldest(1)
            assert oldest.tolist() == [order.pop(0)]
            s.release(oldest)
        order.append(int(s.allocate(ones(1), ones(1), [i], now=0.0)[0]))
        if i % 7 == 3:  # remove from the middle too
            mid = order.pop(1)
            s.release(np.array([mid]))
    assert s.oldest(4).tolist() == order
    assert len(s) == len(order) and s.samples == len(order)


def test_group_storage_refuses_duplicates_and_counts_bytes():
    s = GroupStorage(capacity_samples=8)
    g = make_group("a", rewards=[1.0, 0.0, 1.0, 0.0])
    s.add(g, now=0.0)
    assert "a" in s and s.bytes == group_nbytes(g) == 3 * 4 + 4 * (3 * 4 + 3 * 4)
    with pytest.raises(KeyError, match="already stored"):
        s.add(g, now=0.0)
    s.release(s.oldest(1))
    assert "a" not in s and len(s) == 0 and s.bytes == 0
    with pytest.raises(ValueError, match=r"capacity_samples \(0\) must be >= 1"):
        GroupStorage(0)


def test_slab_storage_gathers_whole_records():
    s = SlabStorage(8, {"tokens": ((3,), np.int32), "logprobs": ((3,), np.float32)})
    rows = {"tokens": np.arange(12, dtype=np.int32).reshape(4, 3), "logprobs": -np.ones((4, 3), np.float32)}
    slots = s.add_batch(rows, np.zeros(4, dtype=np.int64), now=0.0)
    got = s.gather(slots[[2, 0]])
    assert got["tokens"].tolist() == [[6, 7, 8], [0, 1, 2]] and got["logprobs"].shape == (2, 3)
    out = np.empty(2, dtype=s.record)
    s.gather(slots[[3, 1]], out)
    assert out["tokens"].tolist() == [[9, 10, 11], [3, 4, 5]]
    assert s.row_bytes == 24 and s.bytes == 4 * 24
