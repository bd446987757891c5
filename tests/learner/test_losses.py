"""The decoupled PPO loss against numbers worked out by hand."""

import math

import pytest
import torch

from asyncrl.learner.losses import decoupled_ppo_loss

ln = math.log


def row(*xs):
    return torch.tensor([list(xs)], dtype=torch.float32)


def test_on_policy_fresh_data_is_minus_mean_advantage():
    # logprobs == proximal == behaviour: ratio 1, w 1, loss = -mean(A) over the mask.
    lp = row(-1.0, -2.0, -0.5)
    loss, stats = decoupled_ppo_loss(lp, lp, lp, row(1.0, -3.0, 2.0), row(1, 1, 1))
    assert loss.item() == pytest.approx(-(1.0 - 3.0 + 2.0) / 3)
    assert stats["clipfrac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["behaviour_weight_mean"] == pytest.approx(1.0)
    assert stats["behaviour_weight_max"] == pytest.approx(1.0)
    assert stats["behaviour_capped_frac"] == 0.0
    assert stats["behaviour_approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert stats["num_tokens"] == 3.0


def test_clipping_takes_the_pessimistic_branch():
    # token 0: ratio 1.5, A = +1 -> pg1 = -1.5, pg2 = -1.2, max = -1.2 (clipped: no extra credit)
    # token 1: ratio 0.5, A = +1 -> pg1 = -0.5, pg2 = -0.8, max = -0.5 (unclipped: keep the loss)
    # token 2: ratio 0.5, A = -1 -> pg1 = +0.5, pg2 = +0.8, max = +0.8 (clipped)
    # token 3: ratio 1.1, A = -2 -> pg1 = +2.2, pg2 = +2.2, max = +2.2 (inside the clip range)
    prox = row(-1.0, -1.0, -1.0, -1.0)
    lp = prox + row(ln(1.5), ln(0.5), ln(0.5), ln(1.1))
    loss, stats = decoupled_ppo_loss(lp, prox, prox, row(1.0, 1.0, -1.0, -2.0), row(1, 1, 1, 1), clip_coef=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 2.2) / 4, rel=1e-5)
    assert stats["clipfrac"] == pytest.approx(3 / 4)  # |ratio - 1| > 0.2 for tokens 0, 1, 2
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.1) / 4, rel=1e-5)


def test_behaviour_weight_scales_tokens_and_is_capped():
    # w = pi_prox / mu: 2, 0.5, 10 (capped to 5); ratio 1; A = 1, 1, 1 -> token losses -2, -0.5, -5
    prox = row(-1.0, -1.0, -1.0)
    behaviour = prox - row(ln(2.0), ln(0.5), ln(10.0))
    loss, stats = decoupled_ppo_loss(prox, prox, behaviour, row(1.0, 1.0, 1.0), row(1, 1, 1), behaviour_weight_cap=5.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 5.0) / 3, rel=1e-5)
    assert stats["behaviour_weight_mean"] == pytest.approx((2.0 + 0.5 + 10.0) / 3, rel=1e-5)  # before the cap
    assert stats["behaviour_weight_max"] == pytest.approx(10.0, rel=1e-5)
    assert stats["behaviour_capped_frac"] == pytest.approx(1 / 3)
    # k3: (w - 1) - ln w per token
    k3 = [(w - 1) - ln(w) for w in (2.0, 0.5, 10.0)]
    assert stats["behaviour_approx_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)

    uncapped, _ = decoupled_ppo_loss(prox, prox, behaviour, row(1.0, 1.0, 1.0), row(1, 1, 1), behaviour_weight_cap=None)
    assert uncapped.item() == pytest.approx(-(2.0 + 0.5 + 10.0) / 3, rel=1e-5)


def test_mask_excludes_tokens_from_loss_and_stats():
    # Only tokens 0 and 2 count; token 1 has a huge weight and advantage that must not leak in.
    prox = row(-1.0, -1.0, -1.0)
    behaviour = prox - row(0.0, ln(100.0), 0.0)
    loss, stats = decoupled_ppo_loss(prox, prox, behaviour, row(1.0, 1000.0, 3.0), row(1, 0, 1))
    assert loss.item() == pytest.approx(-(1.0 + 3.0) / 2)
    assert stats["behaviour_weight_max"] == pytest.approx(1.0)
    assert stats["behaviour_capped_frac"] == 0.0
    assert stats["num_tokens"] == 2.0


def test_empty_mask_gives_zero_not_nan():
    lp = row(-1.0, -2.0)
    loss, stats = decoupled_ppo_loss(lp, lp, lp, row(1.0, 1.0), row(0, 0))
    assert loss.item() == 0.0 and stats["num_tokens"] == 0.0


def test_gradient_is_weighted_policy_gradient_and_weight_is_detached():
    # With proximal = logprobs.detach(): d loss / d logprobs_t = -w_t * A_t / num_tokens.
    prox = row(-1.0, -2.0)
    lp = prox.clone().requires_grad_(True)
    behaviour = prox - row(ln(2.0), ln(10.0))  # w = 2, 10 -> capped at 5
    loss, _ = decoupled_ppo_loss(lp, lp.detach(), behaviour, row(1.5, -1.0), row(1, 1), behaviour_weight_cap=5.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, row(-2.0 * 1.5 / 2, -5.0 * -1.0 / 2))


def test_rejects_bad_shapes_and_settings():
    lp = row(-1.0, -2.0)
    with pytest.raises(ValueError, match=r"mask shape \(1, 3\) must equal logprobs shape \(1, 2\)"):
        decoupled_ppo_loss(lp, lp, lp, lp, row(1, 1, 1))
    with pytest.raises(ValueError, match=r"clip_coef \(0.0\) must be > 0"):
        decoupled_ppo_loss(lp, lp, lp, lp, row(1, 1), clip_coef=0.0)
    with pytest.raises(ValueError, match=r"behaviour_weight_cap \(0.5\) must be >= 1"):
        decoupled_ppo_loss(lp, lp, lp, lp, row(1, 1), behaviour_weight_cap=0.5)
