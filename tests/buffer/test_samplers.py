import numpy as np
import pytest

from asyncrl.buffer.samplers import FIFOSampler, PrioritizedSampler, UniformSampler, make_sampler
from asyncrl.buffer.storage import SlotStorage
from asyncrl.buffer.sumtree import SPARE_DRAWS

# chi-square critical value, 19 degrees of freedom, p = 0.001
CHI2_19_P001 = 43.82


def prioritized(priorities, **kw) -> PrioritizedSampler:
    s = PrioritizedSampler(capacity=len(priorities), **kw)
    s.add(np.arange(len(priorities)), np.asarray(priorities, dtype=np.float64))
    return s


def test_sampling_frequencies_match_p_i_alpha():
    priorities = np.linspace(0.05, 1.0, 20)
    s = prioritized(priorities, alpha=0.6, seed=1)
    p = priorities**0.6 / (priorities**0.6).sum()  # P(i) = p_i^α / Σ p_k^α
    draws = 20_000
    counts = np.bincount(np.concatenate([s.sample(1, None).slots for _ in range(draws)]), minlength=20)
    chi2 = (((counts - draws * p) ** 2) / (draws * p)).sum()
    assert chi2 < CHI2_19_P001, (chi2, counts, draws * p)
    # and the probabilities handed out are exactly P(i)
    d = s.sample(5, None)
    np.testing.assert_allclose(d.probabilities, p[d.slots], rtol=1e-12)


def test_importance_weights_match_the_formula():
    priorities = np.array([0.1, 0.5, 1.0, 2.0, 4.0])
    s = prioritized(priorities, alpha=0.7, beta=0.5, beta_final=0.5, floor=1e-3)
    d = s.sample(5, None)
    n = len(priorities)
    p = priorities**0.7 / (priorities**0.7).sum()
    w = (n * p) ** -0.5
    np.testing.assert_allclose(d.is_weights, (w / w.max())[d.slots], rtol=1e-12)  # w_i = (N·P(i))^-β / max w
    assert d.is_weights.max() <= 1.0
    assert sorted(d.slots.tolist()) == [0, 1, 2, 3, 4]  # a batch never holds a slot twice


def test_beta_anneals_linearly_to_its_final_value():
    s = prioritized([1.0, 2.0], beta=0.4, beta_final=1.0, beta_anneal_batches=10)
    assert s.beta == pytest.approx(0.4)
    for _ in range(5):
        s.sample(1, None)
    assert s.beta == pytest.approx(0.7)
    for _ in range(20):
        s.sample(1, None)
    assert s.beta == pytest.approx(1.0)


def test_floor_keeps_zero_priority_groups_reachable_and_updates_and_removals_apply():
    s = prioritized([0.0, 0.0, 1.0], alpha=1.0, floor=0.1)
    assert s.priorities(np.arange(3)).tolist() == pytest.approx([0.1, 0.1, 1.0])
    d = s.sample(3, None)
    assert sorted(d.slots.tolist()) == [0, 1, 2]
    s.update(np.array([2]), np.array([0.0]))
    assert s.priorities(np.array([2])).tolist() == pytest.approx([0.1])
    s.remove(np.array([0, 1]))
    assert s.sample(3, None).slots.tolist() == [2]
    s.scale(0.5)  # recency: every priority halves, but not below the floor
    assert s.priorities(np.array([2])).tolist() == pytest.approx([0.1])
    with pytest.raises(ValueError, match=r"priority \(nan\) must be finite and >= 0"):
        s.update(np.array([2]), np.array([np.nan]))


def test_sampler_arguments_are_checked():
    with pytest.raises(ValueError, match=r"alpha \(1.5\) must be in \[0, 1\]"):
        PrioritizedSampler(4, alpha=1.5)
    with pytest.raises(ValueError, match=r"floor \(0\) must be > 0"):
        PrioritizedSampler(4, floor=0)
    with pytest.raises(ValueError, match="beta"):
        PrioritizedSampler(4, beta=0.8, beta_final=0.5)
    with pytest.raises(ValueError, match="sampler"):
        make_sampler("prioritised", 4)


def test_uniform_sampler_ignores_priorities():
    s = UniformSampler(10, seed=0)
    s.add(np.arange(10), np.linspace(0, 100, 10))
    d = s.sample(4, None)
    assert len(set(d.slots.tolist())) == 4
    np.testing.assert_allclose(d.probabilities, 0.1)
    np.testing.assert_allclose(d.is_weights, 1.0)


def test_fifo_sampler_takes_the_oldest_arrivals():
    storage = SlotStorage(max_items=8, capacity_samples=8, capacity_bytes=100)
    slots = storage.allocate(np.ones(5, dtype=np.int64), np.ones(5), np.zeros(5), now=0.0)
    storage.release(slots[1:2])
    d = FIFOSampler().sample(3, storage)
    assert d.slots.tolist() == [slots[0], slots[2], slots[3]]
    assert d.probabilities.tolist() == [1.0] * 3 and d.is_weights.tolist() == [1.0] * 3


class ReferencePER:
    """PER written the straightforward way: priorities in a plain array, a fresh cumulative sum
    per draw, the first k distinct groups of a sequence of draws (k + ``SPARE_DRAWS``, then the
    shortfall drawn again), the smallest priority by ``min``."""

    def __init__(self, capacity, alpha, beta, floor, seed):
        self.leaf = np.zeros(capacity)  # p_i^α, 0 when empty
        self.alpha, self.beta, self.floor = alpha, beta, floor
        self.rng = np.random.default_rng(seed)

    def set(self, slots, priorities):
        for s, p in zip(slots.tolist(), priorities.tolist()):
            self.leaf[s] = max(p, self.floor) ** self.alpha

    def remove(self, slots):
        self.leaf[slots] = 0.0

    def sample(self, k):
        cumsum = np.cumsum(self.leaf)
        total = cumsum[-1]
        chosen = []
        u = self.rng.random(k + SPARE_DRAWS)  # the batch's k, then spares drawn with them
        u[:k].sort()  # i.i.d.: the order of the k is free
        for x in (u * total).tolist():  # the first k distinct groups drawn
            j = int(np.searchsorted(cumsum, x, side="right"))
            if len(chosen) < k and j not in chosen:
                chosen.append(j)
        missing = k - len(chosen)
        while missing:  # draw the shortfall, keep draws of groups not yet taken, in order
            for x in (np.sort(self.rng.random(missing)) * total).tolist():
                j = int(np.searchsorted(cumsum, x, side="right"))
                if j not in chosen:
                    chosen.append(j)
            missing = k - len(chosen)
        slots = np.array(chosen)
        p_min = self.leaf[self.leaf > 0].min()
        return slots, self.leaf[slots] / total, (p_min / self.leaf[slots]) ** self.beta


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize(("capacity", "k"), [(600, 48), (40_000, 256), (150_000, 256)])
def test_fast_paths_draw_the_same_batches_and_weights_as_a_reference_implementation(capacity, k, kernel):
    # 600: small enough that batches often hold duplicates (the spares and the redraw path) and
    # the smallest leaf is often overwritten (its recount); the tree is its top level alone.
    # 40,000: one level under a top of 1,250 nodes (as at 10^5). 150,000: two levels under a top
    # of 147 (as at 10^6).
    rng = np.random.default_rng(7)
    fast = PrioritizedSampler(capacity, alpha=0.6, beta=0.4, beta_final=0.4, floor=0.01, seed=3, kernel=kernel)
    ref = ReferencePER(capacity, alpha=0.6, beta=0.4, floor=0.01, seed=3)
    first = np.arange(capacity)
    priorities = rng.random(capacity) * (rng.random(capacity) > 0.1)  # some 0: lifted to the floor
    fast.add(first, priorities)
    ref.set(first, priorities)
    for step in range(300):
        slots, probabilities, weights = ref.sample(k)
        draw = fast.sample(k, None)
        assert np.array_equal(draw.slots, slots), f"batch {step}"
        np.testing.assert_allclose(draw.probabilities, probabilities, rtol=1e-9)
        np.testing.assert_allclose(draw.is_weights, weights, rtol=1e-12)
        new = rng.random(k) ** 3  # updates that often fall below the smallest priority
        fast.update(slots, new)
        ref.set(slots, new)
        gone = rng.choice(capacity, 8, replace=False)  # removals and re-insertions
        fast.remove(gone)
        ref.remove(gone)
        back = gone[:4]
        fast.add(back, rng.random(4) if step % 2 else np.full(4, 0.5))
        ref.set(back, fast.priorities(back))
    assert fast.tree.total == pytest.approx(ref.leaf.sum(), rel=1e-12)
