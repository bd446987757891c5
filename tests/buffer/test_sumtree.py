import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer.sumtree import SumTree, sample_distinct


class NarrowTree(SumTree):
    """The same tree with rows of 4 under a top of at most 4 nodes: many levels on few leaves."""

    FANOUT = 4
    TOP_NODES = 4


@pytest.mark.parametrize(
    ("make", "n"),
    [(SumTree, 1000), (SumTree, 5000), (SumTree, 100_000), (NarrowTree, 1000), (NarrowTree, 999)],
)
def test_total_min_and_find_against_cumsum(make, n):
    rng = np.random.default_rng(0)
    tree = make(n)
    leaves = rng.random(n) * (rng.random(n) > 0.3)  # ~30% empty leaves
    tree.update(np.arange(n), leaves)
    assert tree.total == pytest.approx(leaves.sum(), rel=1e-12)
    assert tree.min == leaves[leaves > 0].min()
    u = rng.random(5000) * tree.total
    expected = np.searchsorted(np.cumsum(leaves), u, side="right")
    assert (tree.find(u) == expected).mean() > 0.999  # disagreements only at float ties
    assert (leaves[tree.find(u)] > 0).all()  # an empty leaf is never returned
    edges = np.array([0.0, np.nextafter(tree.total, 0), tree.total])  # the ends of the range
    assert tree.find(edges).tolist() == [np.flatnonzero(leaves)[0]] + [np.flatnonzero(leaves)[-1]] * 2


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=300),
    st.integers(0, 2**31 - 1),
    st.sampled_from([SumTree, NarrowTree]),
)
def test_batched_updates_keep_every_parent_the_sum_of_its_children(values, seed, make):
    rng = np.random.default_rng(seed)
    n = len(values)
    tree = make(n)
    truth = np.zeros(n)
    for _ in range(3):  # overlapping batches of distinct indices
        idx = rng.permutation(n)[: rng.integers(1, n + 1)]
        vals = np.array(values)[idx] * rng.random(idx.size)
        tree.update(idx, vals)
        truth[idx] = vals
    assert np.array_equal(tree.values(), truth)
    assert tree.total == pytest.approx(truth.sum(), rel=1e-9, abs=1e-9)
    assert tree.min == (truth[truth > 0].min() if (truth > 0).any() else np.inf)
    if truth.sum() > 0:  # every draw lands where a running sum over the leaves puts it
        # (below the total: with subnormal leaves, random() * total can round up to it)
        u = np.minimum(rng.random(200) * tree.total, np.nextafter(tree.total, 0))
        expected = np.searchsorted(np.cumsum(truth), u, side="right")
        assert (tree.find(u) == expected).mean() > 0.99


@pytest.mark.parametrize("make", [SumTree, NarrowTree])
def test_rounding_at_the_end_never_lands_on_an_empty_leaf(make):
    tree = make(8)
    tree.update(np.array([0, 1, 2]), np.array([0.1, 0.2, 0.3]))
    leaf = tree.find(np.array([tree.total, np.nextafter(tree.total, 0)]))
    assert set(leaf.tolist()) == {2}


@pytest.mark.parametrize("make", [SumTree, NarrowTree])
def test_sample_distinct_returns_distinct_leaves_and_restores_the_tree(make):
    rng = np.random.default_rng(0)
    tree = make(16)
    values = np.array([100.0] + [1.0] * 9 + [0.0] * 6)  # one leaf dominates: duplicates certain
    tree.update(np.arange(16), values)
    chosen, chosen_values = sample_distinct(tree, 8, rng)
    assert chosen.size == 8 and np.unique(chosen).size == 8 and (values[chosen] > 0).all()
    assert np.array_equal(chosen_values, values[chosen])
    assert np.array_equal(tree.values(), values) and tree.total == values.sum()
    # asking for more than the non-empty leaves gives all of them
    assert sorted(sample_distinct(tree, 16, rng)[0].tolist()) == list(range(10))


def test_set_all_and_bad_input():
    tree = SumTree(4)
    tree.set_all(np.array([1.0, 2.0, 0.0, 4.0]))
    assert tree.total == 7.0 and tree.min == 1.0
    with pytest.raises(ValueError, match=r"leaves shape \(3,\) must be \(4,\)"):
        tree.set_all(np.ones(3))
    with pytest.raises(ValueError, match="finite and >= 0"):
        tree.set_all(np.array([1.0, np.nan, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"capacity \(0\) must be >= 1"):
        SumTree(0)
    with pytest.raises(ValueError, match="all 0"):
        SumTree(2).sample(1, np.random.default_rng(0))


@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0, 3.0]])
def test_update_refuses_a_number_of_values_other_than_one_per_leaf(values):
    tree = SumTree(4)
    tree.set_all(np.array([1.0, 2.0, 0.0, 4.0]))
    with pytest.raises(ValueError, match=f"{len(values)} values given for 2 leaves; there must be one per leaf"):
        tree.update(np.array([0, 3]), np.array(values))
    assert tree.values().tolist() == [1.0, 2.0, 0.0, 4.0] and tree.total == 7.0
