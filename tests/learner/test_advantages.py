"""GRPO advantages against values worked out by hand."""

import numpy as np
import pytest
import torch

from asyncrl.learner.advantages import grpo_advantages


def test_two_right_two_wrong():
    # mean 0.5, population std 0.5 -> (r - 0.5) / 0.5
    adv = grpo_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    np.testing.assert_allclose(adv, [[1.0, -1.0, -1.0, 1.0]])


def test_std_is_population_not_sample():
    # r = [0, 0, 3]: mean 1; population var (1 + 1 + 4) / 3 = 2, std sqrt(2)
    # (the sample std, sqrt(3), would give [-0.577, -0.577, 1.155])
    adv = grpo_advantages(np.array([[0.0, 0.0, 3.0]]), eps=0.0)
    s = np.sqrt(2.0)
    np.testing.assert_allclose(adv, [[-1 / s, -1 / s, 2 / s]], rtol=1e-6)


def test_groups_are_independent_and_eps_is_added_to_std():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 4.0]])
    adv = grpo_advantages(rewards, eps=1e-6)
    # row 1: all equal -> 0 (no signal), finite thanks to eps
    # row 2: mean 1, std sqrt((1+1+1+9)/4) = sqrt(3)
    s = np.sqrt(3.0)
    expected = [
        [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)],
        [0.0, 0.0, 0.0, 0.0],
        [-1 / (s + 1e-6), -1 / (s + 1e-6), -1 / (s + 1e-6), 3 / (s + 1e-6)],
    ]
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_without_std_scaling_only_centres():
    adv = grpo_advantages(np.array([[0.0, 0.0, 0.0, 4.0]]), scale_by_std=False)
    np.testing.assert_allclose(adv, [[-1.0, -1.0, -1.0, 3.0]])


def test_torch_in_torch_out_same_values():
    adv = grpo_advantages(torch.tensor([[1, 0, 0, 1]]), eps=0.0)  # integer rewards are fine
    assert isinstance(adv, torch.Tensor) and adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]))


def test_single_sample_group_has_zero_advantage():
    np.testing.assert_allclose(grpo_advantages(np.array([[0.7]])), [[0.0]])


def test_rejects_non_2d():
    with pytest.raises(ValueError, match=r"must be 2-D"):
        grpo_advantages(np.array([1.0, 0.0]))
