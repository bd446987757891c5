import numpy as np

from asyncrl.learner.totals import Reservoir


def test_the_latency_reservoir_keeps_a_uniform_sample_in_fixed_memory():
    reservoir = Reservoir(1_000, seed=1)
    reservoir.extend(float(i) for i in range(500))
    assert len(reservoir.values) == 500 and reservoir.values[-1] == 499.0  # filled in order until full
    reservoir.extend(float(i) for i in range(500, 100_000))
    kept = reservoir.values
    assert len(kept) == 1_000 and reservoir.seen == 100_000
    assert len(set(kept.tolist())) == 1_000  # no value kept twice
    # Uniform over the whole stream: each tenth of it holds about a tenth of the sample.
    counts = np.histogram(kept, bins=10, range=(0, 100_000))[0]
    assert counts.min() > 60 and counts.max() < 140
