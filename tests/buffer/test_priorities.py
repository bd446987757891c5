import numpy as np
import pytest

from asyncrl.buffer.priorities import PRIORITIES, GroupPriority
from asyncrl.learner.advantages import grpo_advantages

REWARDS = np.array([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.2, 0.4, 0.6, 0.8]])


def test_each_priority_is_its_formula():
    np.testing.assert_allclose(PRIORITIES["reward_variance"](REWARDS), [0.25, 0.0, 0.05])
    np.testing.assert_allclose(PRIORITIES["learnability"](REWARDS), [0.25, 0.0, 0.25])  # r̄(1 - r̄)
    np.testing.assert_allclose(PRIORITIES["uniform"](REWARDS), [1.0, 1.0, 1.0])
    # mean |A| with the trainer's GRPO advantages, computed here without torch
    expected = np.abs(grpo_advantages(REWARDS)).mean(axis=1)
    np.testing.assert_allclose(PRIORITIES["mean_abs_advantage"](REWARDS), expected, rtol=1e-6)


def test_priority_ignores_answer_length():
    # the same rewards give the same priority whatever the groups' token counts: only rewards enter
    prio = GroupPriority("reward_variance")
    assert prio([[1.0, 0.0]], [0], 0) == prio([[1.0, 0.0]], [0], 0)


def test_recency_decay_and_ragged_groups():
    prio = GroupPriority("reward_variance", recency_decay=0.5)
    p = prio([[1.0, 0.0], [1.0, 0.0, 1.0, 0.0]], [3, 1], learner_version=3)
    np.testing.assert_allclose(p, [0.25, 0.25 * 0.25])  # 0 and 2 versions old
    with pytest.raises(ValueError, match=r"recency_decay \(0\) must be in \(0, 1\]"):
        GroupPriority("reward_variance", recency_decay=0)
    with pytest.raises(ValueError, match="priority \\('max_seen'\\) must be one of"):
        GroupPriority("max_seen")
