"""A vectorised sum tree (and min tree) over a fixed number of leaves, for prioritized sampling.

Prioritized replay needs three things per batch: draw k leaves with probability proportional to
their values (a prefix-sum descent), read the smallest value (to normalise importance weights),
and change k values. A per-item Python loop costs ~20 levels × k interpreter steps; here every
operation walks the tree once for the whole batch, one numpy call per level on arrays of k
entries, which is what makes ~0.3 µs per item at a million leaves.

Layout: the usual implicit binary heap of ``2L`` nodes (``L`` = leaves rounded up to a power of
two): node 1 is the root, node i has children 2i and 2i+1, leaf j is node L + j. Each node holds
its subtree's sum and its minimum over *non-empty* leaves (an empty leaf, value 0, counts as
+inf), packed side by side as one complex128 (real = sum, imag = min): a parent's update then
reads one cache line for both children's sums and minima instead of four, which is ~15% of an
update at a million leaves, where the time is cache misses, not arithmetic. Parents are
recomputed from their children, never incremented by deltas, so no rounding error accumulates
however many updates are applied.
"""

from __future__ import annotations

import numpy as np


class SumTree:
    """Sums and minima of ``capacity`` non-negative leaves; batched updates and draws.

    >>> t = SumTree(4)
    >>> t.update(np.array([0, 2]), np.array([1.0, 3.0]))
    >>> t.total, t.min
    (4.0, 1.0)
    >>> t.find(np.array([0.5, 1.5, 3.9])).tolist()  # prefix sums: [0, 1) -> 0, [1, 4) -> 2
    [0, 2, 2]
    """

    # Below this many nodes a level (and all above it) is recomputed whole with slices, which
    # is no dearer than chasing k paths by gathers (flat from 512 to 4096 at k = 256).
    SLICE_LEVEL_NODES = 1024
    # A draw starts with a binary search in the prefix sums of the level with this many nodes
    # (measured at 10^6 leaves, k = 256: 42 µs per find at 1024, 69 µs with no shortcut).
    SEARCH_LEVEL_NODES = 1024

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity ({capacity}) must be >= 1")
        self.capacity = capacity
        self._leaves = 1 << max(0, (capacity - 1).bit_length())
        self._depth = self._leaves.bit_length() - 1  # levels below the root
        self._nodes = np.zeros(2 * self._leaves, dtype=np.complex128)  # real: sum, imag: min
        self._sum = self._nodes.real  # views, (2L,)
        self._min = self._nodes.imag
        self._min[:] = np.inf

    @property
    def total(self) -> float:
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """Smallest non-empty leaf; +inf when every leaf is 0."""
        return float(self._min[1])

    def values(self, idx: np.ndarray | None = None) -> np.ndarray:
        """Leaf values at ``idx`` (a copy), or all ``capacity`` leaves (a read-only view) when None."""
        leaves = self._sum[self._leaves : self._leaves + self.capacity]
        if idx is None:
            view = leaves.view()
            view.flags.writeable = False
            return view
        return leaves[idx]

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` (distinct ints) to ``values`` (>= 0; 0 empties a leaf).

        Cost: one pass over the levels for the whole batch, O(k log L) element work in numpy.
        """
        pos = np.asarray(idx, dtype=np.int64) + self._leaves
        values = np.asarray(values, dtype=np.float64)
        nodes = self._nodes
        leaf = np.empty(pos.size, dtype=np.complex128)
        leaf.real = values
        leaf.imag = np.where(values > 0, values, np.inf)
        nodes[pos] = leaf
        level_nodes = self._leaves
        out = leaf  # reused as the scratch of each level
        while level_nodes > 1:
            level_nodes >>= 1
            if level_nodes <= max(self.SLICE_LEVEL_NODES, 2 * pos.size):
                self._rebuild_above(level_nodes)
                return
            pos >>= 1
            left = pos << 1
            a = nodes[left]
            b = nodes[left + 1]  # same cache line as a
            np.add(a.real, b.real, out=out.real)
            np.minimum(a.imag, b.imag, out=out.imag)
            nodes[pos] = out

    def _rebuild_above(self, level_nodes: int) -> None:
        """Recompute every node at the level of ``level_nodes`` nodes and above, from its children."""
        s, m = self._sum, self._min
        n = level_nodes
        while n >= 1:
            np.add(s[2 * n : 4 * n : 2], s[2 * n + 1 : 4 * n : 2], out=s[n : 2 * n])
            np.minimum(m[2 * n : 4 * n : 2], m[2 * n + 1 : 4 * n : 2], out=m[n : 2 * n])
            n >>= 1

    def set_all(self, leaves: np.ndarray) -> None:
        """Replace every leaf at once and rebuild the tree: O(L), for restores and rescaling."""
        leaves = np.asarray(leaves, dtype=np.float64)
        if leaves.shape != (self.capacity,):
            raise ValueError(f"leaves shape {leaves.shape} must be ({self.capacity},)")
        if not (np.isfinite(leaves).all() and (leaves >= 0).all()):
            raise ValueError("leaves must be finite and >= 0")
        lo = self._leaves
        self._sum[lo : lo + self.capacity] = leaves
        self._min[lo : lo + self.capacity] = np.where(leaves > 0, leaves, np.inf)
        if self._leaves > 1:
            self._rebuild_above(self._leaves >> 1)

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """For each prefix sum u in [0, total), the leaf j with cumsum[j-1] <= u < cumsum[j].

        The top of the tree is crossed in one step, a binary search in the prefix sums of the
        level with ``SEARCH_LEVEL_NODES`` nodes (a few µs, instead of ~12 levels of gathers);
        below it, the batched descent: at each level go right when u >= the left child's sum,
        and subtract that sum, one numpy call per level on the whole batch.
        """
        u = np.array(prefix, dtype=np.float64)  # a copy: the descent consumes it
        s = self._sum
        top = min(self._leaves, self.SEARCH_LEVEL_NODES)
        cumsum = np.cumsum(s[top : 2 * top])  # (top,)
        node = np.searchsorted(cumsum, u, side="right")
        np.minimum(node, top - 1, out=node)
        u -= cumsum[node] - s[top + node]  # minus the mass left of `node`
        pos = node + top
        for _ in range(self._depth - (top.bit_length() - 1)):
            pos <<= 1
            left = s[pos]
            right = u >= left
            u -= left * right
            pos += right
        leaf = pos - self._leaves
        # Rounding can leave u just past the last non-empty leaf of a subtree; step back onto it.
        empty = s[pos] <= 0
        if empty.any():
            leaf[empty] = self._nearest_nonempty(leaf[empty])
        return leaf

    def _nearest_nonempty(self, leaf: np.ndarray) -> np.ndarray:
        nonempty = np.flatnonzero(self.values() > 0)
        if nonempty.size == 0:
            raise ValueError("cannot draw from a tree whose leaves are all 0")
        at = np.clip(np.searchsorted(nonempty, leaf) - 1, 0, nonempty.size - 1)
        return nonempty[at]

    def sample(self, k: int, rng: np.random.Generator) -> np.ndarray:
        """``k`` leaves drawn with replacement, P(j) = value_j / total."""
        if self.total <= 0:
            raise ValueError("cannot draw from a tree whose leaves are all 0")
        return self.find(rng.random(k) * self.total)


def sample_distinct(tree: SumTree, k: int, rng: np.random.Generator, max_rounds: int = 64) -> np.ndarray:
    """``k`` distinct leaves (fewer if fewer are non-empty), drawn in proportion to their values.

    A batch must not hold one group twice. Round 1 draws k with replacement (with many leaves
    duplicates are rare: ~k²/2N expected); the drawn leaves are then zeroed and the shortfall
    drawn again, until k distinct leaves are found; the zeroed leaves are restored at the end.
    This is successive sampling without replacement. Returns leaves in draw order.
    """
    chosen = tree.sample(k, rng)
    order = np.sort(chosen)
    if chosen.size < 2 or (order[1:] != order[:-1]).all():
        return chosen  # the common case: no duplicate, no tree writes
    _, first = np.unique(chosen, return_index=True)
    chosen = chosen[np.sort(first)]
    saved = tree.values(chosen).copy()
    taken = [chosen]
    excluded = [chosen]
    tree.update(chosen, np.zeros(chosen.size))
    missing = k - chosen.size
    try:
        for _ in range(max_rounds):
            if missing == 0 or tree.total <= 0:
                break
            more = tree.sample(missing, rng)
            _, first = np.unique(more, return_index=True)
            more = more[np.sort(first)]
            taken.append(more)
            excluded.append(more)
            saved = np.concatenate([saved, tree.values(more)])
            tree.update(more, np.zeros(more.size))
            missing -= more.size
    finally:
        tree.update(np.concatenate(excluded), saved)
    return np.concatenate(taken)
