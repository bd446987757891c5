"""The compiled sum tree (numba) against the numpy one: the same batches, weights and sums.

The reference implementation (``ReferencePER`` in test_samplers.py) checks both kernels on its
own; here the two are run side by side on one history, including the paths a reference run
rarely takes (duplicates past the spares, the smallest leaf's recount, restores, β annealing).
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.buffer.compiled_tree import CompiledSumTree
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.buffer.samplers import PrioritizedSampler, make_tree
from asyncrl.buffer.storage import SlabStorage
from asyncrl.buffer.sumtree import SumTree


class NarrowCompiledTree(CompiledSumTree):
    """Rows of 4 under a top of at most 4 nodes: many levels on few leaves."""

    FANOUT = 4
    TOP_NODES = 4


class NarrowTree(SumTree):
    FANOUT = 4
    TOP_NODES = 4


def pair(capacity: int, **kw) -> tuple[PrioritizedSampler, PrioritizedSampler]:
    kw = {"alpha": 0.6, "beta": 0.4, "beta_final": 1.0, "beta_anneal_batches": 50, "seed": 3, **kw}
    return PrioritizedSampler(capacity, kernel="numpy", **kw), PrioritizedSampler(capacity, kernel="numba", **kw)


def assert_same_draw(a, b, step) -> None:
    assert np.array_equal(a.slots, b.slots), f"batch {step}"
    np.testing.assert_allclose(b.probabilities, a.probabilities, rtol=1e-12, err_msg=f"batch {step}")
    np.testing.assert_allclose(b.is_weights, a.is_weights, rtol=1e-12, err_msg=f"batch {step}")


@pytest.mark.parametrize(("capacity", "k"), [(40, 24), (600, 48), (40_000, 256), (150_000, 256)])
def test_numba_and_numpy_samplers_draw_the_same_batches_and_weights(capacity, k):
    # 40 leaves and batches of 24: duplicates past the spares (the redraw path) in most batches.
    rng = np.random.default_rng(11)
    numpy_side, numba_side = pair(capacity)
    priorities = rng.random(capacity) * (rng.random(capacity) > 0.1)
    for s in (numpy_side, numba_side):
        s.add(np.arange(capacity), priorities)
    for step in range(120):
        a, b = numpy_side.sample(k, None), numba_side.sample(k, None)
        assert_same_draw(a, b, step)
        new = rng.random(a.slots.size) ** 3  # often below the smallest leaf; its last copy often overwritten
        gone = rng.choice(capacity, max(1, capacity // 50), replace=False)
        back = gone[: gone.size // 2]
        for s in (numpy_side, numba_side):
            s.update(a.slots, new)
            s.remove(gone)
            s.add(back, np.full(back.size, 0.5), removed=np.setdiff1d(gone, back)[:1])
    assert numba_side.tree.total == pytest.approx(numpy_side.tree.total, rel=1e-12)
    # A leaf is max(p, floor)^alpha: numba calls the C library's pow, numpy's power has SIMD code
    # of its own on AVX-512 CPUs, and there ~6 % of such powers differ in their last bit (the
    # draws above stayed the same: a draw moves to another leaf only within ~1e-16 of a bound).
    assert numba_side.tree.min == pytest.approx(numpy_side.tree.min, rel=1e-15)
    np.testing.assert_array_max_ulp(numba_side.tree.values(), numpy_side.tree.values(), maxulp=1)


@pytest.mark.parametrize(
    ("compiled", "plain", "n"), [(CompiledSumTree, SumTree, 5000), (NarrowCompiledTree, NarrowTree, 999)]
)
def test_compiled_tree_keeps_the_sums_of_the_numpy_tree(compiled, plain, n):
    rng = np.random.default_rng(0)
    c, p = compiled(n), plain(n)
    for _ in range(20):
        idx = rng.permutation(n)[: rng.integers(1, n)]
        values = rng.random(idx.size) * (rng.random(idx.size) > 0.3)
        c.update(idx, values)
        p.update(idx, values)
    assert np.array_equal(c.values(), p.values())
    assert c.total == pytest.approx(p.total, rel=1e-12) and c.min == p.min
    leaves = p.values()
    u = rng.random(5000) * c.total
    expected = np.searchsorted(np.cumsum(leaves), u, side="right")
    assert (c.find(u.copy()) == expected).mean() > 0.999  # disagreements only at float ties
    assert (leaves[c.find(u.copy())] > 0).all()
    # a rebuild from the leaves gives the same tree as the updates did (its sums, not its state)
    rebuilt = compiled(n)
    rebuilt.set_all(leaves)
    sums = slice(0, c._layout[-3])  # every level's values, prefixes and bounds
    assert np.array_equal(rebuilt._buf[sums], c._buf[sums])


def test_a_sampler_state_restores_into_either_kernel_with_the_same_next_batches():
    rng = np.random.default_rng(5)
    source, _ = pair(20_000)
    source.add(np.arange(20_000), rng.random(20_000))
    for _ in range(7):
        source.sample(256, None)
    state = source.state()
    numpy_side, numba_side = pair(20_000)
    numpy_side.load_state(state)
    numba_side.load_state(state)
    for step in range(5):
        expected = source.sample(256, None)
        assert_same_draw(expected, numpy_side.sample(256, None), step)
        assert_same_draw(expected, numba_side.sample(256, None), step)


def test_a_bad_priority_is_refused_by_value_and_nothing_is_written():
    s = PrioritizedSampler(8, kernel="numba")
    s.add(np.arange(4), np.ones(4))
    before = s.tree._buf.copy()
    with pytest.raises(ValueError, match=r"priority \(nan\) must be finite and >= 0"):
        s.update(np.array([0, 1]), np.array([0.5, np.nan]))
    with pytest.raises(ValueError, match=r"priority \(-1.0\) must be finite and >= 0"):
        s.add(np.array([5]), np.array([-1.0]))
    assert np.array_equal(s.tree._buf, before)
    s.remove(np.arange(4))
    with pytest.raises(ValueError, match="all 0"):
        s.sample(1, None)


def test_the_kernel_is_chosen_by_name():
    assert type(make_tree(10, "numpy")) is SumTree
    assert type(make_tree(10, "numba")) is CompiledSumTree
    assert type(make_tree(10, "auto")) is CompiledSumTree  # numba is a dependency: it imports
    with pytest.raises(ValueError, match=r"kernel \('cuda'\) must be one of"):
        make_tree(10, "cuda")
    with pytest.raises(ValueError, match="kernel"):
        BufferConfig(kernel="cuda")


@pytest.mark.slow  # imports vLLM (~10 s)
def test_vllm_can_still_start_an_engine_after_numba_compiled_in_the_process():
    # vLLM's CPU platform scans every module attribute when it starts an engine; llvmlite's
    # library wrapper failed that scan (asyncrl.compiled._let_vllm_scan_llvmlite).
    # The scan itself, with no kernel to rebind: what failed before the engine could start.
    from vllm.triton_utils.dispatcher import _rebind_kernels

    CompiledSumTree(8).update(np.array([1]), np.array([1.0]))
    _rebind_kernels([])


@pytest.mark.parametrize("capacity", [300, 5000])
def test_numba_and_numpy_buffers_hand_out_the_same_batches_keys_and_counts(capacity):
    # The whole buffer, bookkeeping included (keys, first hand-outs, ignored priority updates).
    rng = np.random.default_rng(2)
    cfg = {"capacity_samples": capacity, "beta_final": 0.4, "max_times_sampled": 3, "max_staleness": None, "seed": 4}
    bufs = [
        ReplayBuffer.from_config(BufferConfig(kernel=kernel, **cfg), storage=SlabStorage(capacity, {}))
        for kernel in ("numpy", "numba")
    ]
    stale_keys = np.array([-5, 10**12], dtype=np.int64)  # a negative key and one never stored
    for step in range(60):
        k = int(rng.integers(1, 64))
        priorities, versions = rng.random(k), np.zeros(k, dtype=np.int64)
        keys = [buf.insert_batch(np.zeros(k, dtype=buf.storage.record), versions, priorities) for buf in bufs]
        assert np.array_equal(keys[0], keys[1])
        batches = [buf.sample(32) for buf in bufs]
        assert np.array_equal(batches[0].keys, batches[1].keys), f"batch {step}"
        assert np.array_equal(batches[0].first_time, batches[1].first_time)
        np.testing.assert_allclose(batches[1].is_weights, batches[0].is_weights, rtol=1e-12)
        update = np.concatenate([batches[0].keys, stale_keys])
        new = rng.random(update.size)
        applied = [buf.update_priorities(update, new) for buf in bufs]
        assert applied[0] == applied[1]
    for name in ("sampled", "resampled", "removed"):
        assert getattr(bufs[0], name) == getattr(bufs[1], name)
    assert bufs[0].priority_updates_ignored == bufs[1].priority_updates_ignored > 0
    assert np.array_equal(bufs[0].storage.times_sampled, bufs[1].storage.times_sampled)
    bufs[1].reconcile()
