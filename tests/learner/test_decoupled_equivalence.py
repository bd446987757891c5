"""decoupled_ppo_loss and compute_policy_loss (decoupled, ppo_clip, token-mean) are the same loss,
bit for bit, value and gradient, on random inputs."""

import pytest
import torch

from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.losses import compute_policy_loss, decoupled_ppo_loss


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("clip_coef, cap", [(0.2, 5.0), (0.1, None), (0.28, 1.5), (0.2, 1.0)])
def test_decoupled_ppo_loss_is_compute_policy_loss_bit_for_bit(seed, clip_coef, cap):
    g = torch.Generator().manual_seed(seed)
    shape = (int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
    prox = -torch.rand(shape, generator=g) * 4
    mu = prox + torch.randn(shape, generator=g) * (0.1 + seed / 5)  # weights well past the cap too
    adv = torch.randn(shape, generator=g) * 2
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    base = prox + 0.4 * torch.randn(shape, generator=g)  # some ratios outside the clip range
    for proximal in (None, prox):  # the trainer's one-update form (pi_prox = pi_theta) and a given one
        lp1 = base.clone().requires_grad_(True)
        lp2 = base.clone().requires_grad_(True)
        p1 = lp1.detach() if proximal is None else proximal
        p2 = lp2.detach() if proximal is None else proximal
        old, _ = decoupled_ppo_loss(lp1, p1, mu, adv, mask, clip_coef=clip_coef, behaviour_weight_cap=cap)
        algo = AlgorithmConfig(
            correction="decoupled",
            policy_loss="ppo_clip",
            loss_agg_mode="token-mean",
            clip_low=clip_coef,
            clip_high=clip_coef,
            is_cap=cap,
        )
        new, _ = compute_policy_loss(lp2, p2, mu, adv, mask, algo)
        assert torch.equal(old, new)
        old.backward()
        new.backward()
        assert torch.equal(lp1.grad, lp2.grad)
