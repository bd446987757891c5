"""The sum tree with its batch operations compiled by numba: one call per draw or update.

Why: ``SumTree``'s numpy operations spend their time in numpy's per-call overhead, not in
arithmetic: a batch of 256 costs ~35 calls to sample and ~45 to update, each ~1–3 µs whatever
its size (bench/README.md, the buffer section). Here a whole operation is one call into machine
code that loops over the batch: a draw of k + ``SPARE_DRAWS`` leaves (sort, descent, a step off
an empty leaf, duplicates replaced by spares, P(i) and importance weights), an update (scattered
leaf writes, the smallest leaf's count, the touched rows and their parents at every level).

Why numba: see ``asyncrl.compiled`` (its settings, and the fix that lets vLLM start an engine
beside it, applied on import). The first ``CompiledSumTree`` of a fresh install compiles for
~10–15 s on a loaded 2-core machine, later ones load the cache in ~0.4 s, always at
construction, never inside a draw.

Same tree, same draws: the kernels read and write ``SumTree``'s own arrays (views into one
buffer, levels at offsets) with the arithmetic of its numpy methods in the same order: the same
subtractions on the way down, the same formulas for P(i) and the weights, a row's prefix sums
left to right. numpy sums a row by a matrix product, which may add in another order and differ
in the last bit, so a draw within an ulp of a boundary between two leaves may go either way
(as it already could against a running sum over the leaves); otherwise the two draw the same
leaves and weights for the same generator state, and a snapshot taken from either restores into
either (tests/buffer/test_compiled_tree.py).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from asyncrl.buffer.sumtree import SPARE_DRAWS, SumTree, _distinct, _one_per_leaf
from asyncrl.compiled import jit

_INF = np.inf


@intrinsic
def _prefetch(typingctx, array, index):
    """Start loading the cache line of ``array[index]`` and return at once (LLVM's
    ``llvm.prefetch``: a read, to be kept in every cache level); never faults, even out of bounds.

    numba has no prefetch of its own; this emits the one instruction where it is called.
    """

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data
        return context.get_dummy_value()

    return numba.types.void(array, index), codegen


# The tree's state besides its arrays, at ``_STATE`` in its buffer, that kernels update in place:
_MIN, _MIN_COUNT, _MIN_KNOWN, _CUM_FRESH = range(4)  # smallest leaf, leaves equal to it, flags (0/1)
_LACKS_MIN = -2  # what a draw returns when the smallest leaf must first be recounted (numpy, O(L))

# ``SumTree._layout``: levels T below the top, log2 f, f, capacity, then the offsets in the buffer
# of value levels 0..T, prefix levels 0..T, bound levels 0..T, the top's cumulative sums, the state.


@jit
def _value(lay, level):
    return lay[4 + level]


@jit
def _prefix(lay, level):
    return lay[4 + lay[0] + 1 + level]


@jit
def _bound(lay, level):
    return lay[4 + 2 * (lay[0] + 1) + level]


@jit
def _cum(lay):
    return lay[4 + 3 * (lay[0] + 1)]


@jit
def _state(lay):
    return lay[5 + 3 * (lay[0] + 1)]


@jit
def _refresh_cum(buf, lay):
    """0 then the cumulative sums of the top level, left to right (``np.add.accumulate``'s order)."""
    top, cum = _value(lay, lay[0]), _cum(lay)
    s = 0.0
    buf[cum] = 0.0
    for i in range(_state(lay) - cum - 1):
        s += buf[top + i]
        buf[cum + i + 1] = s
    buf[_state(lay) + _CUM_FRESH] = 1.0


@jit
def _nearest_nonempty(buf, leaf, capacity):
    """The last non-empty leaf before ``leaf``, else the first after it; -1 if none
    (``SumTree._nearest_nonempty``). The leaves are at the buffer's start."""
    j = min(leaf, capacity) - 1
    while j >= 0:
        if buf[j] > 0:
            return j
        j -= 1
    j = leaf + 1
    while j < capacity:
        if buf[j] > 0:
            return j
        j += 1
    return -1


# How many draws ahead a descent prefetches the rows it will read. Measured at 10^6 leaves, the
# batch's draw (``_sample``) took ~55 µs without; ~42 with the bounds and the leaves' whole value
# rows 6–8 draws ahead, and ~7 % less again prefetching a leaf's one value line once its index is
# known. Prefetching every row as soon as its parent is known gained less: the processor drops
# prefetches while its line-fill buffers are full.
_AHEAD = 8


@jit
def _fetch_bounds(buf, lay, level, parent):
    """Prefetch the bounds of ``parent``'s children at ``level`` (32 doubles, four or five
    cache lines)."""
    shift, f = lay[1], lay[2]
    row = _bound(lay, level) + (parent << shift)
    for q in range(0, f, 8):
        _prefetch(buf, row + q)
    _prefetch(buf, row + f - 1)


@jit
def _descend(buf, lay, u, leaf, values):
    """``SumTree._descend`` for every u (overwritten): leaves and their values into ``leaf`` and
    ``values``; 0, or -1 when every leaf is 0.

    Level by level across all draws, as the numpy descent, and without branches on the data: the
    draws' memory reads (a random row per level, far apart in a large tree) are independent, so
    the processor overlaps their cache misses; a draw at a time, branching on each comparison,
    waits for each miss in turn (measured: slower than numpy at 10^6 leaves). The bisection's
    reads within a row depend on one another, though, so each draw also prefetches the rows of the
    draw ``_AHEAD`` after it, whose misses are then overlapped with its own work. The child's index
    is how many of its row's bounds are <= u, found by bisection (the last is +inf): rows are
    non-decreasing (sums of non-negative numbers, left to right), so that is the first bound
    above u, as numpy finds it.
    """
    st = _state(lay)
    if buf[st + _CUM_FRESH] == 0.0:
        _refresh_cum(buf, lay)
    levels, shift, f, capacity, cum = lay[0], lay[1], lay[2], lay[3], _cum(lay)
    m = u.size
    # The top: how many of cum[1:-1] are <= u (numpy's searchsorted(..., "right")). While the u
    # ascend (the batch's k, sorted) by one walk along the cumulative sums, ~top + m steps that
    # the processor predicts; then, for the spares after them, by a branch-free bisection.
    n_top = st - cum - 2
    node, walked, last = 0, 0, -_INF
    while walked < m and u[walked] >= last:
        x = last = u[walked]
        while node < n_top and buf[cum + node + 1] <= x:
            node += 1
        leaf[walked] = node
        u[walked] = x - buf[cum + node]
        walked += 1
    for i in range(walked, m):
        x = u[i]
        base, n = 0, n_top
        while n > 1:
            half = n >> 1
            base = base + half if buf[cum + base + half + 1] <= x else base
            n -= half
        node = base + (1 if n_top > 0 and buf[cum + base + 1] <= x else 0)
        leaf[i] = node
        u[i] = x - buf[cum + node]
    for level in range(levels - 1, -1, -1):
        b, p = _bound(lay, level), _prefix(lay, level)
        for i in range(min(_AHEAD, m)):
            _fetch_bounds(buf, lay, level, leaf[i])
        for i in range(m):
            if i + _AHEAD < m:
                _fetch_bounds(buf, lay, level, leaf[i + _AHEAD])
            row = b + (leaf[i] << shift)
            x = u[i]
            c, half = 0, f >> 1
            while half:  # branch-free bisection of the row: ~2 of its 4 cache lines read, not 4
                c = c + half if buf[row + c + half - 1] <= x else c
                half >>= 1
            node = (leaf[i] << shift) + c
            leaf[i] = node
            if level:
                u[i] = x - buf[p + node]
            else:
                _prefetch(buf, node)  # its value, read after the last draw's descent
    for i in range(m):
        j = leaf[i]
        v = buf[j]
        if v <= 0:  # rounding left u just past a subtree's last non-empty leaf
            j = _nearest_nonempty(buf, j, capacity)
            if j < 0:
                return -1
            leaf[i] = j
            v = buf[j]
        values[i] = v
    return 0


@jit
def _sample(buf, lay, u, k, beta, leaf, prob, weight):
    """PER's batch (``SumTree.sample_prioritized``) from k + spares uniforms ``u`` in [0, 1), the
    first k sorted (the caller sorts: numpy's sort is faster than numba's on a few hundred).

    Writes the distinct leaves into ``leaf`` and returns how many: k, or fewer when duplicates
    used up the spares (the caller draws the rest); with k, also P(i) and w_i into ``prob`` and
    ``weight``. -1: every leaf is 0; ``_LACKS_MIN``: the smallest leaf is to be recounted first.
    """
    st = _state(lay)
    if buf[st + _MIN_KNOWN] == 0.0:
        return _LACKS_MIN
    if buf[st + _CUM_FRESH] == 0.0:
        _refresh_cum(buf, lay)
    total = buf[st - 1]  # the last cumulative sum
    if not total > 0:
        return -1
    u *= total
    m = u.size
    drawn = np.empty(m, dtype=np.int64)
    vals = np.empty(m)
    if _descend(buf, lay, u, drawn, vals):
        return -1
    n = 0
    for i in range(k):  # the first k (ascending: twins adjacent), each leaf once
        if i == 0 or drawn[i] != drawn[i - 1]:
            leaf[n] = drawn[i]
            prob[n] = vals[i]
            n += 1
    if n < k:
        distinct = n  # leaf[:distinct] ascending: searched by bisection; spares after it by a scan
        for i in range(k, m):
            if n == k:
                break
            j = drawn[i]
            lo, hi = 0, distinct
            while lo < hi:
                mid = (lo + hi) >> 1
                if leaf[mid] < j:
                    lo = mid + 1
                else:
                    hi = mid
            taken = lo < distinct and leaf[lo] == j
            for t in range(distinct, n):
                taken = taken or leaf[t] == j
            if not taken:
                leaf[n] = j
                prob[n] = vals[i]
                n += 1
        if n < k:
            return n
    smallest, inv_total = buf[st + _MIN], 1.0 / total
    for i in range(k):
        v = prob[i]
        prob[i] = v * inv_total  # P(i) = p_i^α / Σ_k p_k^α
        weight[i] = (smallest / v) ** beta  # w_i = (min_j p_j^α / p_i^α)^β
    return k


@jit
def _refresh_rows(buf, lay, level, parents, m):
    """``SumTree._refresh``: the rows of ``parents[:m]`` at ``level``, summed left to right."""
    shift, f = lay[1], lay[2]
    vb, vp, bb, pb = _value(lay, level), _value(lay, level + 1), _bound(lay, level), _prefix(lay, level)
    for j in range(m):
        parent = parents[j]
        row = parent << shift
        s = 0.0
        for c in range(f - 1):
            s += buf[vb + row + c]
            buf[bb + row + c] = s
            if level:
                buf[pb + row + c + 1] = s  # exclusive prefixes: the inclusive ones, shifted
        s += buf[vb + row + f - 1]
        buf[bb + row + f - 1] = _INF
        buf[vp + parent] = s


@jit
def _update(buf, lay, idx, new):
    """``SumTree.update``: leaves ``idx`` (distinct) set to ``new``, the smallest leaf tracked
    (``SumTree._track_min``), every touched row and parent recomputed from its children."""
    n = idx.size
    st = _state(lay)
    smallest, count, known = buf[st + _MIN], buf[st + _MIN_COUNT], buf[st + _MIN_KNOWN] != 0.0
    if known and count > 0:
        for i in range(n):
            if buf[idx[i]] == smallest:
                count -= 1
        known = count > 0
    low = _INF
    for i in range(n):
        if 0 < new[i] < low:
            low = new[i]
    if low < _INF:
        equal = 0
        for i in range(n):
            if new[i] == low:
                equal += 1
        if low < smallest or (low == smallest and not known):
            smallest, count, known = low, equal, True
        elif low == smallest:
            count += equal
    buf[st + _MIN], buf[st + _MIN_COUNT], buf[st + _MIN_KNOWN] = smallest, count, 1.0 if known else 0.0
    for i in range(n):
        buf[idx[i]] = new[i]
    buf[st + _CUM_FRESH] = 0.0
    levels, shift = lay[0], lay[1]
    if levels == 0 or n == 0:
        return
    parents = np.empty(n, dtype=np.int64)
    for i in range(n):
        parents[i] = idx[i] >> shift
    parents.sort()
    for level in range(levels):
        m = 0  # the distinct parents, ascending
        for i in range(n):
            if i == 0 or parents[i] != parents[m - 1]:
                parents[m] = parents[i]
                m += 1
        _refresh_rows(buf, lay, level, parents, m)
        for i in range(m):
            parents[i] >>= shift
        n = m


@jit
def _update_powered(buf, lay, idx, x, floor, alpha):
    """``_update`` with leaves max(x_i, floor)^α; returns the index of the first x_i that is not
    finite and >= 0 (nothing written then), else -1."""
    new = np.empty(x.size)
    for i in range(x.size):
        v = x[i]
        if not (v >= 0 and v < _INF):  # NaN fails the first
            return i
        new[i] = max(v, floor) ** alpha
    _update(buf, lay, idx, new)
    return -1


@jit
def _refresh_all(buf, lay):
    """Every row of every level recomputed (``SumTree.set_all``)."""
    for level in range(lay[0]):
        parents = np.arange(_value(lay, level + 2) - _value(lay, level + 1))
        _refresh_rows(buf, lay, level, parents, parents.size)
    buf[_state(lay) + _CUM_FRESH] = 0.0


class CompiledSumTree(SumTree):
    """``SumTree`` whose update, descent and PER batch draw are compiled (numba), one call each.

    >>> t = CompiledSumTree(4)
    >>> t.update(np.array([0, 2]), np.array([1.0, 3.0]))
    >>> t.total, t.min, t.find(np.array([0.5, 1.5, 3.9])).tolist()
    (4.0, 1.0, [0, 2, 2])
    """

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._state_view[:] = (_INF, 0.0, 1.0, 0.0)  # smallest leaf, its count, known, cum fresh
        compile_kernels()

    # -- the smallest leaf and the total, kept in the buffer's state the kernels update --------

    @property
    def min(self) -> float:
        if self._state_view[_MIN_KNOWN] == 0.0:
            self._recompute_min()
        return float(self._state_view[_MIN])

    def _recompute_min(self) -> None:
        super()._recompute_min()
        self._state_view[:3] = (self._min, self._min_count, 1.0)

    def _cumsum(self) -> np.ndarray:
        if self._state_view[_CUM_FRESH] == 0.0:
            _refresh_cum(self._buf, self._layout)
        return self._cum_view

    # -- the compiled operations ---------------------------------------------------------------

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        idx, values = _one_per_leaf(idx, values)
        _update(self._buf, self._layout, idx, values)

    def update_powered(self, idx: np.ndarray, x: np.ndarray, floor: float, alpha: float) -> None:
        idx, x = _one_per_leaf(idx, x)
        bad = _update_powered(self._buf, self._layout, idx, x, floor, alpha)
        if bad >= 0:
            raise ValueError(f"priority ({x[bad]}) must be finite and >= 0")

    def set_all(self, leaves: np.ndarray) -> None:
        self._value[0][: self.capacity] = self._checked_leaves(leaves)
        _refresh_all(self._buf, self._layout)
        self._recompute_min()

    def _descend(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        leaf, values = np.empty(u.size, dtype=np.int64), np.empty(u.size)
        if _descend(self._buf, self._layout, u, leaf, values):
            raise ValueError("cannot draw from a tree whose leaves are all 0")
        return leaf, values

    def sample_prioritized(
        self, k: int, rng: np.random.Generator, beta: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        u = rng.random(k + SPARE_DRAWS)
        u[:k].sort()
        leaf, prob, weight = np.empty(k, dtype=np.int64), np.empty(k), np.empty(k)
        n = _sample(self._buf, self._layout, u, k, beta, leaf, prob, weight)
        if n == _LACKS_MIN:  # the last smallest leaf rose or left: recount it (O(L)), then draw
            self._recompute_min()
            n = _sample(self._buf, self._layout, u, k, beta, leaf, prob, weight)
        if n == k:
            return leaf, prob, weight
        if n < 0:
            raise ValueError("cannot draw from a tree whose leaves are all 0")
        # Duplicates used up the spares (rare with many leaves): ``sample_distinct``'s redraws.
        total, smallest = self.total, self.min
        leaf = _distinct(self, k, rng, leaf[:n].copy(), 64)
        values = self.values(leaf)
        return leaf, values * (1.0 / total), np.power(smallest / values, beta)


_compiled = False


def compile_kernels() -> None:
    """Compile (or load from numba's cache) every kernel once per process, on a small tree, so
    that no call on a real tree pays for it. ``scripts/setup.sh`` calls it once per install, so
    that numba's cache holds the machine code before the first run (compiling takes ~10 s)."""
    global _compiled
    if _compiled:
        return
    _compiled = True
    tree = CompiledSumTree(2 * SumTree.TOP_NODES * SumTree.FANOUT)  # (its compile_kernels returns at once)
    leaves = np.arange(1.0, tree.capacity + 1)
    tree.set_all(leaves)
    tree.update(np.arange(0, tree.capacity, 7), leaves[::7] / 2)
    tree.update_powered(np.arange(0, tree.capacity, 5), leaves[::5], 0.01, 0.6)
    tree.find(np.array([0.5, tree.total / 2]))
    tree.sample_prioritized(4, np.random.default_rng(0), 0.5)
