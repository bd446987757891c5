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


# --- the references' forms: token-level whitening, the std estimator, OPO, pass@k ----------------

from asyncrl.learner.advantages import opo_advantages, pass_at_k_advantages  # noqa: E402
from asyncrl.learner.config import AlgorithmConfig  # noqa: E402
from asyncrl.learner.group_advantages import group_advantages, loss_lengths  # noqa: E402
from tests.factories import make_group  # noqa: E402


def test_reinforce_pp_whitens_over_tokens_so_long_answers_weigh_more():
    r = np.array([[1.0, 0.0], [1.0, 1.0]])
    lengths = np.array([[3, 1], [1, 1]])
    # tokens: five carry 1, one carries 0 -> mean 5/6, var (5 (1/6)^2 + (5/6)^2) / 6 = 5/36
    s = np.sqrt(5 / 36)
    expected = [[(1 / 6) / s, (-5 / 6) / s], [(1 / 6) / s, (1 / 6) / s]]
    np.testing.assert_allclose(reinforce_pp_advantages(r, lengths=lengths, eps=0.0), expected, rtol=1e-6)
    torch.testing.assert_close(
        reinforce_pp_advantages(torch.tensor(r), lengths=lengths, eps=0.0), torch.tensor(expected, dtype=torch.float64)
    )
    # the sequence form is the one before: every sample once, mean 0.75, std sqrt(0.1875)
    s = np.sqrt(0.1875)
    seq = reinforce_pp_advantages(r, lengths=lengths, whitening="sequence", eps=0.0)
    np.testing.assert_allclose(seq, [[0.25 / s, -0.75 / s], [0.25 / s, 0.25 / s]], rtol=1e-6)
    # group baseline: [[0.5, -0.5], [0, 0]] over tokens 3x0.5, 1x-0.5, 2x0 -> mean 1/6, var 5/36... by hand:
    # mean (1.5 - 0.5) / 6 = 1/6; var (3 (1/3)^2 + (2/3)^2 + 2 (1/6)^2) / 6 = (1/3 + 4/9 + 1/18) / 6 = 5/36
    s = np.sqrt(5 / 36)
    np.testing.assert_allclose(
        reinforce_pp_advantages(r, group_baseline=True, lengths=lengths, eps=0.0),
        [[(1 / 3) / s, (-2 / 3) / s], [(-1 / 6) / s, (-1 / 6) / s]],
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match=r"whitening \('tokens'\) must be 'token' or 'sequence'"):
        reinforce_pp_advantages(r, whitening="tokens")


def test_unbiased_std_scales_grpo_by_sqrt_n_minus_one_over_n():
    r = np.array([[1.0, 0.0]])
    np.testing.assert_allclose(grpo_advantages(r, eps=0.0), [[1.0, -1.0]])
    np.testing.assert_allclose(grpo_advantages(r, eps=0.0, unbiased=True), [[np.sqrt(0.5), -np.sqrt(0.5)]])
    torch.testing.assert_close(
        grpo_advantages(torch.tensor(r), eps=0.0, unbiased=True), torch.tensor([[np.sqrt(0.5), -np.sqrt(0.5)]])
    )
    # REINFORCE++ over 4 samples [1, 0, 0, 1] (one token each): std 0.5, unbiased sqrt(1/3)
    np.testing.assert_allclose(
        reinforce_pp_advantages(np.array([[1.0, 0.0], [0.0, 1.0]]), eps=0.0, unbiased=True),
        [[0.5 / np.sqrt(1 / 3), -0.5 / np.sqrt(1 / 3)], [-0.5 / np.sqrt(1 / 3), 0.5 / np.sqrt(1 / 3)]],
    )


def test_opo_baseline_is_the_length_weighted_mean_reward():
    # b = (3 * 1 + 1 * 0) / 4 = 0.75
    np.testing.assert_allclose(opo_advantages(np.array([[1.0, 0.0]]), lengths=np.array([[3, 1]])), [[0.25, -0.75]])
    # equal lengths: Dr. GRPO's plain mean; a group of empty answers too
    np.testing.assert_allclose(opo_advantages(np.array([[1.0, 0.0]]), lengths=np.array([[0, 0]])), [[0.5, -0.5]])
    torch.testing.assert_close(
        opo_advantages(torch.tensor([[2.0, 0.0, 1.0]]), lengths=np.array([[1, 2, 1]])),
        torch.tensor([[1.25, -0.75, 0.25]]),
    )
    with pytest.raises(ValueError, match=r"opo needs each sample's response length"):
        opo_advantages(np.array([[1.0, 0.0]]))


def test_pass_at_k_matches_the_binary_closed_form_and_grpo_at_k_1():
    # N = 4, one right: R_bar = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2;
    # A_pos = (1 - 1/2) / (1/2) = 1, A_neg = (1 - 1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3
    np.testing.assert_allclose(
        pass_at_k_advantages(np.array([[1.0, 0.0, 0.0, 0.0]]), k=2, eps=0.0), [[1.0, -1 / 3, -1 / 3, -1 / 3]]
    )
    r = np.array([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4]])
    np.testing.assert_allclose(pass_at_k_advantages(r, k=1), grpo_advantages(r), rtol=1e-6)
    with pytest.raises(ValueError, match=r"k \(5\) must be in \[1, group size 4\]"):
        pass_at_k_advantages(r, k=5)


def test_pass_at_k_with_graded_rewards_by_hand():
    # [0, 1, 2], k = 2: pairs {0,1} -> 1, {0,2} -> 2, {1,2} -> 2: R_bar = 5/3, E[max^2] = 3, var = 2/9;
    # answer 0 is in {0,1}, {0,2}: 1.5; answer 1 in {0,1}, {1,2}: 1.5; answer 2: 2
    s = np.sqrt(2 / 9)
    expected = [[(1.5 - 5 / 3) / s, (1.5 - 5 / 3) / s, (2 - 5 / 3) / s]]
    np.testing.assert_allclose(pass_at_k_advantages(np.array([[0.0, 1.0, 2.0]]), k=2, eps=0.0), expected, rtol=1e-6)
    out = pass_at_k_advantages(torch.tensor([[0.0, 1.0, 2.0]]), k=2, eps=0.0)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32))


def test_group_advantages_weigh_by_the_tokens_in_the_loss():
    groups = [make_group("a", n=2, rewards=[1.0, 0.0], length=3), make_group("b", n=2, rewards=[1.0, 1.0], length=1)]
    groups[0].samples[1].response_ids = groups[0].samples[1].response_ids[:1]  # lengths [[3, 1], [1, 1]]
    rows = group_advantages(AlgorithmConfig(adv_estimator="reinforce_pp"), groups)
    expected = reinforce_pp_advantages(np.array([[1.0, 0.0], [1.0, 1.0]]), lengths=np.array([[3, 1], [1, 1]]))
    np.testing.assert_allclose(np.stack(rows), expected, rtol=1e-6)
    seq = group_advantages(AlgorithmConfig(adv_estimator="reinforce_pp", reinforce_pp_whitening="sequence"), groups)
    np.testing.assert_allclose(np.stack(seq), reinforce_pp_advantages(np.array([[1.0, 0.0], [1.0, 1.0]])), rtol=1e-6)
    opo = group_advantages(AlgorithmConfig(adv_estimator="opo"), groups)
    np.testing.assert_allclose(np.stack(opo), [[0.25, -0.75], [0.0, 0.0]])
    unbiased = group_advantages(AlgorithmConfig(std_estimator="unbiased"), groups)
    np.testing.assert_allclose(unbiased[0], [np.sqrt(0.5), -np.sqrt(0.5)], rtol=1e-5)
    # truncation mode mask: a truncated answer's tokens are out of the loss, so out of the statistics
    groups[0].samples[0].finish_reason = "length"
    masked = AlgorithmConfig(adv_estimator="opo", truncation={"mode": "mask"})
    assert [row.tolist() for row in loss_lengths(masked, groups)] == [[0.0, 1.0], [1.0, 1.0]]
    np.testing.assert_allclose(group_advantages(masked, groups)[0], [1.0, 0.0])


def test_reinforce_pp_per_token_credits_each_token_with_what_it_and_later_tokens_earned():
    import torch

    from asyncrl.learner.advantages import reinforce_pp_advantages, reinforce_pp_token_advantages

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # an observation token out of the loss
    returns = torch.tensor([2.0, 0.0])
    # without per-token rewards: the sequence form, tokens weighing each sequence
    plain = reinforce_pp_token_advantages(returns, torch.zeros(2, 4), mask)
    expected = reinforce_pp_advantages(returns.numpy()[None], lengths=mask.sum(1).numpy()[None])[0]
    assert torch.allclose(plain[0, :3], torch.tensor(expected[0]).float().expand(3), atol=1e-5)
    # a reward of 1 on the first token: tokens after it no longer get it, the first one still does
    token = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    adv = reinforce_pp_token_advantages(returns, token, mask)
    assert adv[0, 0] > adv[0, 1] == adv[0, 2] and adv[0, 3] == 0 and adv[1, 2:].abs().sum() == 0
    trained = adv[mask.bool()]
    assert abs(trained.mean().item()) < 1e-6 and abs(trained.std(unbiased=False).item() - 1) < 1e-4


def test_the_step_gives_reinforce_pp_each_tokens_return_when_tokens_carry_rewards():
    import numpy as np

    from asyncrl.learner.batch import collate
    from asyncrl.learner.config import AlgorithmConfig
    from asyncrl.learner.step import per_token_returns, reinforce_pp_per_token
    from tests.factories import make_group

    group = make_group("g", n=2, rewards=[1.0, 0.0], length=3)
    batch = collate([group], [np.zeros(2, np.float32)], pad_id=0)
    algo = AlgorithmConfig(adv_estimator="reinforce_pp")
    assert not per_token_returns(algo, batch)  # no per-token reward: one advantage per sequence
    group.samples[0].token_rewards = np.array([0.5, 0.0, 0.0], np.float32)
    batch = collate([group], [np.zeros(2, np.float32)], pad_id=0)
    assert per_token_returns(algo, batch) and not per_token_returns(AlgorithmConfig(adv_estimator="grpo"), batch)
    adv = reinforce_pp_per_token(algo, [group], batch, [np.array([1.0, 0.0])], weights=[2.0])
    first = adv[0][batch.response_mask[0].bool()]
    assert first[0] > first[1] == first[2]  # the token that earned 0.5 keeps it; later ones do not
    half = reinforce_pp_per_token(algo, [group], batch, [np.array([1.0, 0.0])], weights=[1.0])
    assert np.allclose(adv.numpy(), 2 * half.numpy())  # the group's importance weight scales it
