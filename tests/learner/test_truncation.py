"""The overlong penalty (DAPO eq. 13) and the truncation config's checks."""

import numpy as np
import pytest

from asyncrl.config import RunConfig
from asyncrl.learner.config import AlgorithmConfig, TruncationConfig
from asyncrl.learner.truncation import is_truncated, overlong_penalty
from tests.factories import make_group


def test_overlong_penalty_is_zero_then_linear_to_minus_one_at_l_max():
    # L_max 10, L_cache 4: free up to 6 tokens, then -1/4 per token, -1 at 10 and beyond
    lengths = [0, 6, 7, 8, 10, 12]
    np.testing.assert_allclose(overlong_penalty(lengths, 10, 4), [0, 0, -0.25, -0.5, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 10, 4, penalty=0.5), [0, 0, -0.125, -0.25, -0.5, -0.5])
    assert overlong_penalty([3], 10, 4).dtype == np.float32
    with pytest.raises(ValueError, match=r"cache_tokens \(11\) must be in \(0, max_tokens \(10\)\]"):
        overlong_penalty([3], 10, 11)


def test_is_truncated_reads_finish_reason():
    group = make_group(n=3, rewards=[1.0, 0.0, 1.0])
    group.samples[1].finish_reason = "length"
    assert is_truncated(group).tolist() == [False, True, False]


def test_truncation_defaults_and_checks():
    assert TruncationConfig().mode == "keep"
    assert TruncationConfig(mode="penalise").interval(20480) == (20480, 4096)  # DAPO's L_cache
    assert TruncationConfig(mode="penalise", max_tokens=100, cache_tokens=10).interval(512) == (100, 10)
    with pytest.raises(ValueError, match=r"cache_tokens \(50\) must be <= its max_tokens \(40\)"):
        TruncationConfig(mode="penalise", cache_tokens=50).interval(40)
    with pytest.raises(ValueError, match=r"truncation.max_tokens \(64\) must be <= sampling.max_tokens \(32\)"):
        RunConfig(sampling={"max_tokens": 32}, algorithm={"truncation": {"mode": "penalise", "max_tokens": 64}})
    with pytest.raises(ValueError, match="mode"):
        AlgorithmConfig(truncation={"mode": "filter"})
