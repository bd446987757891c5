"""The slot bookkeeping of a hand-out and of a priority update, compiled (numba): one call each.

``ReplayBuffer.sample`` names each drawn slot's item by its key and counts the hand-out
(``times_sampled``, and whether it is the first); ``update_priorities`` maps the learner's keys
back to slots and drops those whose item has left. In numpy each is ~5 calls of ~1–3 µs on 256
items; here one loop (``buffer.kernel``, as ``asyncrl.buffer.compiled_tree``, whose import also
lets vLLM start an engine in the same process).
"""

from __future__ import annotations

import numpy as np

from asyncrl.buffer.compiled_tree import jit
from asyncrl.buffer.storage import SlotStorage


@jit
def _mark_sampled(seq, times_sampled, slots, max_items, keys, first):
    n = 0
    for i in range(slots.size):
        j = slots[i]
        keys[i] = seq[j] * max_items + j  # SlotStorage.keys
        t = times_sampled[j]
        first[i] = t == 0
        n += 1 if t == 0 else 0
        times_sampled[j] = t + 1
    return n


@jit
def _slots_of(seq, keys, max_items, slots, valid):
    n = 0
    for i in range(keys.size):
        key = keys[i]
        s, j = key // max_items, key % max_items  # floor division, as np.divmod
        slots[i] = j
        ok = s >= 0 and seq[j] == s
        valid[i] = ok
        n += 1 if ok else 0
    return n


def mark_sampled(storage: SlotStorage, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``SlotStorage.mark_sampled``, compiled."""
    keys, first = np.empty(slots.size, dtype=np.int64), np.empty(slots.size, dtype=np.bool_)
    n = _mark_sampled(storage.seq, storage.times_sampled, slots, storage.max_items, keys, first)
    return keys, first, n


def slots_of(storage: SlotStorage, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``SlotStorage.slots_of``, compiled, with how many are valid."""
    slots, valid = np.empty(keys.size, dtype=np.int64), np.empty(keys.size, dtype=np.bool_)
    n = _slots_of(storage.seq, keys, storage.max_items, slots, valid)
    return slots, valid, n
