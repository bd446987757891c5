"""GRPO advantages against values worked out by hand."""

import math

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


# --- the other estimators ---------------------------------------------------------------------

from asyncrl.learner.advantages import (  # noqa: E402
    ADV_ESTIMATORS,
    gae_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    vtrace_targets,
)


def test_dr_grpo_is_centred_only():
    np.testing.assert_allclose(ADV_ESTIMATORS["dr_grpo"](np.array([[0.0, 0.0, 0.0, 4.0]])), [[-1.0, -1.0, -1.0, 3.0]])


def test_rloo_is_minus_the_mean_of_the_others():
    # sample 0: 1 - (0 + 0 + 1) / 3 = 2/3; sample 1: 0 - (1 + 0 + 1) / 3 = -2/3
    np.testing.assert_allclose(rloo_advantages(np.array([[1.0, 0.0, 0.0, 1.0]])), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    with pytest.raises(ValueError, match=r"group size \(1\) must be >= 2"):
        rloo_advantages(np.array([[1.0]]))


def test_reinforce_pp_whitens_over_the_batch():
    r = np.array([[1.0, 0.0], [1.0, 1.0]])
    # no baseline: mean 0.75, std sqrt(0.1875)
    s = np.sqrt(0.1875)
    np.testing.assert_allclose(
        reinforce_pp_advantages(r, eps=0.0), [[0.25 / s, -0.75 / s], [0.25 / s, 0.25 / s]], rtol=1e-6
    )
    # group baseline: [[0.5, -0.5], [0, 0]], batch mean 0, std sqrt(0.125)
    s = np.sqrt(0.125)
    np.testing.assert_allclose(
        reinforce_pp_advantages(r, group_baseline=True, eps=0.0), [[0.5 / s, -0.5 / s], [0.0, 0.0]], rtol=1e-6
    )
    assert ADV_ESTIMATORS["reinforce_pp_baseline"](torch.tensor(r)).shape == (2, 2)


def test_remax_subtracts_the_greedy_reward():
    np.testing.assert_allclose(remax_advantages(np.array([[1.0, 0.0, 1.0]]), np.array([1.0])), [[0.0, -1.0, 0.0]])
    with pytest.raises(ValueError, match=r"must be \(1,\): one per group"):
        remax_advantages(np.array([[1.0, 0.0]]), np.array([1.0, 0.0]))


def test_gae_by_hand_with_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])  # the last position is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # lam 0.5: deltas 0.1, 0.1, 0.3 -> A2 = 0.3, A1 = 0.1 + 0.15, A0 = 0.1 + 0.125
    adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3, 0.0]]))


def test_vtrace_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # on-policy: the lambda = 1 return
    vs, adv = vtrace_targets(rewards, values, torch.zeros(1, 3), mask)
    torch.testing.assert_close(vs, torch.tensor([[1.0, 1.0, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    # pi/mu = 0.5 at the last token: rho = c = 0.5 there -> v2 = 0.85, v1 = v0 = 0.85
    vs, adv = vtrace_targets(rewards, values, torch.tensor([[0.0, 0.0, math.log(0.5)]]), mask)
    torch.testing.assert_close(vs, torch.tensor([[0.85, 0.85, 0.85]]))
    torch.testing.assert_close(adv, torch.tensor([[0.35, 0.25, 0.15]]))
