"""A vectorised sum tree over a fixed number of leaves, with the smallest leaf kept beside it.

Prioritized replay needs three things per batch: draw k leaves with probability proportional to
their values (a prefix-sum descent), read the smallest value (to normalise importance weights),
and change k values. A per-item Python loop costs ~20 levels × k interpreter steps; here every
operation touches the tree with a handful of numpy calls for the whole batch.

Layout: a wide tree, not the textbook binary heap. Leaves are grouped in rows of ``FANOUT``
(32) children per parent, the parents again in rows of ``FANOUT``, until a level has at most
``TOP_NODES`` (4096) nodes: 10^6 leaves take two levels below a top of 977 nodes, 10^5 one
below a top of 3,125, up to 4096 leaves none. Each node below the top stores its value and its *exclusive
prefix*, the sum of the siblings left of it in its row.

Where this differs from the textbook tree (and from TorchRL's and Reverb's), and why:

- **A draw crosses a level in a few numpy calls on a (k, 32) block**, instead of 20 levels of
  one call each on k numbers: the prefix rows of the k current parents are gathered, compared
  with the k remainders, and the first prefix above each remainder found by ``argmin``; the top
  is a binary search in the cumulative sums of at most 4096 nodes. A binary numpy tree spends
  its draw in the per-call overhead of ~5 calls × ~20 levels (PER's sampling is latency-bound at
  batch 256, not bandwidth-bound); here it is ~8 calls × 2 levels.
- **An update recomputes the touched rows' prefixes by one matrix product**, rows @ T with T
  the (32, 32) strictly upper triangular ones (a BLAS call: ~5x faster than ``np.cumsum`` along
  rows), once per level for the distinct touched parents. Every prefix and parent is recomputed
  from its children, never incremented: nothing drifts, and no rebuild is ever needed.
- **No min tree.** The smallest non-empty leaf is kept as a number with the count of leaves
  holding it: a write below it replaces it, a write of it counts up, overwriting one counts down;
  only when the count reaches 0 (the last smallest leaf rose or left) is it recomputed, O(L),
  and lazily, on the next read. With leaves drawn from a continuous range that happens about
  once per L/k batches; with equal leaves (uniform sampling, the floor) the count stays large.

The prefix sums are computed in a different order from a single running sum over the leaves,
so a draw that lands within a few ulps of a boundary between two leaves may go either way
(~1e-13 of draws). Sums of non-negative numbers are monotone under rounding, so prefixes never
decrease along a row; a draw that rounding still leaves on an empty leaf is moved onto the
nearest non-empty one.
"""

from __future__ import annotations

import numpy as np


class SumTree:
    """Sums of ``capacity`` non-negative leaves and their smallest non-empty value; batched
    updates and draws.

    >>> t = SumTree(4)
    >>> t.update(np.array([0, 2]), np.array([1.0, 3.0]))
    >>> t.total, t.min
    (4.0, 1.0)
    >>> t.find(np.array([0.5, 1.5, 3.9])).tolist()  # prefix sums: [0, 1) -> 0, [1, 4) -> 2
    [0, 2, 2]
    """

    FANOUT = 32  # children per parent: a power of two (measured at 10^6 and 10^5: 32 > 16, 64)
    TOP_NODES = 4096  # the top level, searched in its cumulative sums, has at most this many nodes

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity ({capacity}) must be >= 1")
        self.capacity = capacity
        f = self.FANOUT
        sizes = [capacity]  # nodes per level, leaves first
        while sizes[-1] > self.TOP_NODES:
            sizes.append(-(-sizes[-1] // f))
        self._sizes = sizes
        # Levels below the top, padded with empty nodes so that every node of the level above,
        # padding included, has a whole row of children (a descent that rounding pushes onto a
        # padding node stays in bounds): f·top, f²·top, ... nodes, < capacity + f^levels leaves.
        padded = [sizes[-1] * f ** (len(sizes) - 1 - lv) for lv in range(len(sizes))]
        # Every array of the tree is a view into one float64 buffer, whose offsets ``_layout``
        # holds: numpy reads the views, a compiled kernel (``asyncrl.buffer.compiled_tree``) the
        # buffer and the layout (two arguments to pass instead of a dozen). Per kind, levels
        # 0 (the leaves) to T (the top), a kind without a level there holding 0 numbers:
        #   value:  every node's value;
        #   prefix: exclusive prefixes, read by a draw to carry its remainder down a level (none
        #           for the leaves, below which nothing is carried, nor for the top);
        #   bound:  the same sums, inclusive, each row's last replaced by +inf: the bounds a draw
        #           compares with (how many are <= u is the child's index; +inf caps it at f - 1);
        # then the top's cumulative sums (top + 1) and 4 numbers of state, for the compiled tree.
        top = len(sizes) - 1
        prefix_sizes = ([0] + padded[1:-1] + [0])[: top + 1]
        parts = padded + prefix_sizes + padded[:-1] + [0] + [padded[-1] + 1, 4]
        off = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(parts, out=off[1:])
        self._buf = np.zeros(int(off[-1]))
        views = [self._buf[off[i] : off[i + 1]] for i in range(len(parts))]
        self._value = views[: top + 1]
        self._prefix = views[top + 1 : 2 * top + 2]
        self._bound = views[2 * top + 2 : 3 * top + 3]
        self._cum_view, self._state_view = views[3 * top + 3 :]
        self._layout = np.concatenate([[top, f.bit_length() - 1, f, capacity], off]).astype(np.int64)
        for bound in self._bound:
            bound.reshape(-1, f)[:, -1] = np.inf
        self._bound_rows = [bound.reshape(-1, f) for bound in self._bound]  # (nodes / f, f) views
        self._upper = np.triu(np.ones((f, f)))  # (f, f): rows @ _upper = inclusive prefix sums
        self._top_cumsum: np.ndarray | None = None  # (top + 1,) 0 then cumulative sums; None: stale
        self._min = np.inf  # smallest non-empty leaf when _min_known, else a strict lower bound
        self._min_count = 0  # leaves equal to _min
        self._min_known = True

    def _cumsum(self) -> np.ndarray:
        if self._top_cumsum is None:
            top = self._value[-1]
            cum = np.zeros(top.size + 1)
            np.add.accumulate(top, out=cum[1:])  # (np.cumsum: the same sums, through a wrapper)
            self._top_cumsum = cum
        return self._top_cumsum

    @property
    def total(self) -> float:
        return float(self._cumsum()[-1])

    @property
    def min(self) -> float:
        """Smallest non-empty leaf; +inf when every leaf is 0."""
        if not self._min_known:
            self._recompute_min()
        return float(self._min)

    def _recompute_min(self) -> None:
        leaves = self.values()
        nonempty = leaves[leaves > 0]
        self._min = float(nonempty.min()) if nonempty.size else np.inf
        self._min_count = int(np.count_nonzero(nonempty == self._min))
        self._min_known = True

    def values(self, idx: np.ndarray | None = None) -> np.ndarray:
        """Leaf values at ``idx`` (a copy), or all ``capacity`` leaves (a read-only view) when None."""
        if idx is not None:
            return self._value[0].take(idx)  # (idx < capacity; the padding beyond holds 0)
        view = self._value[0][: self.capacity]
        view.flags.writeable = False
        return view

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` (distinct ints) to ``values`` (>= 0; 0 empties a leaf).

        Cost: per level, one gather, one (rows, 32) @ (32, 32) product and two scatters over the
        distinct parents of the written nodes.
        """
        idx, values = _one_per_leaf(idx, values)  # numpy's put would repeat or drop values without a word
        leaves = self._value[0]
        self._track_min(leaves.take(idx), values)
        leaves.put(idx, values)
        self._top_cumsum = None
        if len(self._sizes) == 1 or idx.size == 0:
            return
        shift = self.FANOUT.bit_length() - 1
        parents = np.sort(idx >> shift)
        for level in range(len(self._sizes) - 1):
            keep = np.empty(parents.size, dtype=bool)  # the distinct parents, ascending
            keep[0] = True
            np.not_equal(parents[1:], parents[:-1], out=keep[1:])
            parents = parents[keep]
            self._refresh(level, parents)
            parents = parents >> shift

    def update_powered(self, idx: np.ndarray, x: np.ndarray, floor: float, alpha: float) -> None:
        """``update`` with leaves max(x_i, floor)^α (PER's p_i^α, the floor applied); raises
        unless every x_i is finite and >= 0."""
        self.update(idx, powered(x, floor, alpha))

    def _refresh(self, level: int, parents: np.ndarray) -> None:
        """Recompute the prefixes of ``parents``' rows at ``level`` and the parents' values."""
        f = self.FANOUT
        rows = self._value[level].reshape(-1, f).take(parents, axis=0)  # (p, f)
        inclusive = rows @ self._upper  # (p, f)
        self._value[level + 1][parents] = inclusive[:, -1]
        if level:
            # Exclusive prefixes are the inclusive ones shifted: the very numbers a draw compared
            # with, so what it subtracts never exceeds its remainder.
            self._prefix[level].reshape(-1, f)[parents, 1:] = inclusive[:, :-1]
        inclusive[:, -1] = np.inf
        self._bound_rows[level][parents] = inclusive

    def _track_min(self, old: np.ndarray, new: np.ndarray) -> None:
        # Invariant: every non-empty leaf is >= _min, and when _min_known, some leaf (exactly
        # _min_count of them) equals it; when not known, every non-empty leaf is > _min.
        if self._min_known and self._min_count:
            self._min_count -= int(np.count_nonzero(old == self._min))
            self._min_known = self._min_count > 0
        low = float(new.min()) if new.size else np.inf
        if low <= 0:  # empty leaves do not count
            nonempty = new[new > 0]
            low = float(nonempty.min()) if nonempty.size else np.inf
        if low == np.inf:
            return
        if low < self._min or (low == self._min and not self._min_known):
            self._min, self._min_count, self._min_known = low, int(np.count_nonzero(new == low)), True
        elif low == self._min:
            self._min_count += int(np.count_nonzero(new == low))

    def _checked_leaves(self, leaves: np.ndarray) -> np.ndarray:
        """``leaves`` as float64, one per leaf, each finite and >= 0 (``set_all``'s argument)."""
        leaves = np.asarray(leaves, dtype=np.float64)
        if leaves.shape != (self.capacity,):
            raise ValueError(f"leaves shape {leaves.shape} must be ({self.capacity},)")
        if not (np.isfinite(leaves).all() and (leaves >= 0).all()):
            raise ValueError("leaves must be finite and >= 0")
        return leaves

    def set_all(self, leaves: np.ndarray) -> None:
        """Replace every leaf at once and rebuild the tree: O(L), for restores and rescaling."""
        self._value[0][: self.capacity] = self._checked_leaves(leaves)
        for level in range(len(self._sizes) - 1):
            self._refresh(level, np.arange(self._value[level + 1].size))
        self._top_cumsum = None
        self._recompute_min()

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """For each prefix sum u in [0, total), the leaf j with cumsum[j-1] <= u < cumsum[j]."""
        return self._descend(np.asarray(prefix, dtype=np.float64))[0]

    def _descend(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(k,) leaves for the (k,) prefix sums ``u`` (overwritten), and the (k,) values there.

        The top level is crossed by a binary search in its cumulative sums; each level below by
        comparing the remainders with the (k, 32) inclusive prefix sums of their parents' rows:
        the child's index is how many are <= the remainder (``argmin`` of the comparison: the
        first that is not; the row's last bound is +inf), and the sum left of it is subtracted,
        except below the last level, where nothing reads the remainder. Remainders stay >= 0
        exactly: what is subtracted is one of the bounds found <= them.
        """
        cum = self._cumsum()
        # The last bound (the total) left out, as +inf caps the rows below: u >= total by
        # rounding still lands in the last node. (Methods, not np.*: no dispatch wrapper.)
        node = cum[1:-1].searchsorted(u, "right")
        u -= cum.take(node)  # (k,) what is left below `node`
        f = self.FANOUT
        shift = f.bit_length() - 1
        below = u[:, None]  # (k, 1): a view of u, which the loop updates in place
        for level in range(len(self._sizes) - 2, -1, -1):
            bounds = self._bound_rows[level].take(node, axis=0)  # (k, f)
            node <<= shift
            node += np.less_equal(bounds, below).argmin(axis=1)  # + the child's index
            if level:
                u -= self._prefix[level].take(node)
        leaf = node
        values = self._value[0].take(leaf)
        # Rounding can leave u just past the last non-empty leaf of a subtree; step back onto it.
        if not values.all():
            empty = values <= 0
            leaf[empty] = self._nearest_nonempty(leaf[empty])
            values = self._value[0].take(leaf)
        return leaf, values

    def _nearest_nonempty(self, leaf: np.ndarray) -> np.ndarray:
        nonempty = np.flatnonzero(self.values() > 0)
        if nonempty.size == 0:
            raise ValueError("cannot draw from a tree whose leaves are all 0")
        at = np.clip(np.searchsorted(nonempty, leaf) - 1, 0, nonempty.size - 1)
        return nonempty[at]

    def sample_prioritized(
        self, k: int, rng: np.random.Generator, beta: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """PER's batch: ``k`` distinct leaves (``sample_distinct``), their P(i) = value_i / total
        and importance weights w_i = (min_j value_j / value_i)^β."""
        total, smallest = self.total, self.min
        leaf, values = sample_distinct(self, k, rng)
        return leaf, values * (1.0 / total), np.power(smallest / values, beta)

    def sample(self, k: int, rng: np.random.Generator) -> np.ndarray:
        """``k`` leaves drawn with replacement, P(j) = value_j / total, in ascending order."""
        return self.draw(k, rng)[0]

    def draw(self, k: int, rng: np.random.Generator, extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``sample`` of ``k + extra`` leaves, and their values: the first k ascending, the
        ``extra`` after them in the order drawn (spares for a caller that rejects some).

        The k uniform draws are sorted before the descent (the draws are i.i.d., so their order
        carries nothing): the leaves come out ascending (a duplicate sits next to its twin), and
        the gathers of each level touch memory in order.
        """
        total = self.total
        if total <= 0:
            raise ValueError("cannot draw from a tree whose leaves are all 0")
        u = rng.random(k + extra)
        u[:k].sort()
        u *= total
        return self._descend(u)


def _one_per_leaf(idx, values) -> tuple[np.ndarray, np.ndarray]:
    """``idx`` as int64 and ``values`` as float64; raises unless there is one value per leaf."""
    idx, values = np.asarray(idx, dtype=np.int64), np.asarray(values, dtype=np.float64)
    if idx.shape != values.shape:
        raise ValueError(f"{values.size} values given for {idx.size} leaves; there must be one per leaf")
    return idx, values


def powered(x: np.ndarray, floor: float, alpha: float) -> np.ndarray:
    """max(x_i, floor)^α (α = 0: all ones); raises unless every x_i is finite and >= 0."""
    x = np.asarray(x, dtype=np.float64)
    if x.size and not (x.min() >= 0 and x.max() < np.inf):  # two reductions; NaN fails the first
        bad = x[~(np.isfinite(x) & (x >= 0))][0]
        raise ValueError(f"priority ({bad}) must be finite and >= 0")
    return np.maximum(x, floor) ** alpha


def _first_new(drawn: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Of ``drawn`` (ascending, as ``SumTree.sample`` returns them), each leaf once, in order,
    leaving out those in ``taken`` (ascending): duplicates are neighbours, membership a search."""
    keep = np.empty(drawn.size, dtype=bool)
    keep[:1] = True
    np.not_equal(drawn[1:], drawn[:-1], out=keep[1:])
    fresh = drawn[keep]
    if taken.size and fresh.size:
        at = np.minimum(np.searchsorted(taken, fresh), taken.size - 1)
        fresh = fresh[taken[at] != fresh]
    return fresh


SPARE_DRAWS = 16
"""Draws made beside every batch's k, in the same descent, to replace duplicates without another."""


def sample_distinct(
    tree: SumTree, k: int, rng: np.random.Generator, max_rounds: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """``k`` distinct leaves (fewer if fewer are non-empty), drawn in proportion to their values.

    A batch must not hold one group twice: this is successive sampling without replacement,
    each next leaf drawn with P(j) = value_j / (total - Σ values already taken), which is keeping
    the first k distinct leaves of a sequence of i.i.d. draws (a repeat is a rejected draw). The
    sequence starts with k + ``SPARE_DRAWS`` draws in one descent: the k form the batch when they
    are distinct (with many leaves duplicates are rare: ~k²/2N expected), else the spares, in
    order, replace the repeats. Past the spares, the shortfall is drawn again from the whole tree
    and draws of leaves already taken are rejected, still without writing the tree; only when a
    draw would be rejected more often than not (the taken leaves hold over half the mass) are
    they zeroed in the tree, the rest drawn, and their values restored. Returns leaves in draw
    order (the first k ascending, ``SumTree.draw``) and their values.
    """
    drawn, values = tree.draw(k, rng, SPARE_DRAWS)
    chosen = drawn[:k]  # ascending: a duplicate sits next to its twin
    if chosen.size < 2 or (chosen[1:] != chosen[:-1]).all():
        return chosen, values[:k]  # the common case: no duplicate
    chosen = _first_new(chosen, np.zeros(0, dtype=np.int64))
    taken = set(chosen.tolist())
    spares = []
    for leaf in drawn[k:].tolist():  # (a few: a Python loop is cheaper than a numpy round)
        if len(taken) == k:
            break
        if leaf not in taken:
            taken.add(leaf)
            spares.append(leaf)
    chosen = np.concatenate([chosen, np.array(spares, dtype=np.int64)])
    if chosen.size < k:
        chosen = _distinct(tree, k, rng, chosen, max_rounds)
    return chosen, tree.values(chosen)


def _distinct(tree: SumTree, k: int, rng: np.random.Generator, chosen: np.ndarray, max_rounds: int) -> np.ndarray:
    """``sample_distinct`` past a first round that drew duplicates: ``chosen`` are its leaves."""
    for _ in range(max_rounds):
        missing = k - chosen.size
        if missing == 0:
            return chosen
        if tree.values(chosen).sum() > 0.5 * tree.total:
            break  # a draw would be rejected more often than not: exclude them from the tree
        more = _first_new(tree.sample(missing, rng), np.sort(chosen))
        chosen = np.concatenate([chosen, more])
    saved = tree.values(chosen).copy()
    excluded = [chosen]
    taken = [chosen]
    tree.update(chosen, np.zeros(chosen.size))
    missing = k - chosen.size
    try:
        for _ in range(max_rounds):
            if missing == 0 or not (tree.values() > 0).any():  # (rounding may leave total > 0)
                break
            more = _first_new(tree.sample(missing, rng), np.zeros(0, dtype=np.int64))
            taken.append(more)
            excluded.append(more)
            saved = np.concatenate([saved, tree.values(more)])
            tree.update(more, np.zeros(more.size))
            missing -= more.size
    finally:
        tree.update(np.concatenate(excluded), saved)
    return np.concatenate(taken)
