"""KL estimators and controllers against values worked out by hand."""

import math

import pytest
import torch

from asyncrl.learner.config import KLConfig
from asyncrl.learner.kl import K3_BOUND, KL_ESTIMATORS, AdaptiveKLController, FixedKLController, make_kl_controller


def test_estimators_by_hand():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # log r = 0.5, -1
    torch.testing.assert_close(KL_ESTIMATORS["k1"](lp, ref), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(KL_ESTIMATORS["k2"](lp, ref), torch.tensor([[0.125, 0.5]]))
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    torch.testing.assert_close(KL_ESTIMATORS["k3"](lp, ref), torch.tensor([k3]))
    torch.testing.assert_close(KL_ESTIMATORS["abs"](lp, ref), torch.tensor([[0.5, 1.0]]))


def test_every_estimator_is_zero_at_the_reference_and_k3_is_never_negative():
    lp = -torch.rand(4, 6) * 4
    for fn in KL_ESTIMATORS.values():
        torch.testing.assert_close(fn(lp, lp), torch.zeros_like(lp))
    assert (KL_ESTIMATORS["k3"](lp, lp + torch.randn(4, 6)) >= 0).all()


def test_k3_is_unbiased_for_the_true_kl():
    # pi and ref over 3 tokens; E_{x~pi}[k3] = KL(pi || ref)
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.3, 0.5])
    exact = (pi * (pi / ref).log()).sum()
    expected_k3 = (pi * KL_ESTIMATORS["k3"](pi.log(), ref.log())).sum()
    expected_k1 = (pi * KL_ESTIMATORS["k1"](pi.log(), ref.log())).sum()
    assert expected_k3.item() == pytest.approx(exact.item(), rel=1e-5)
    assert expected_k1.item() == pytest.approx(exact.item(), rel=1e-5)


def test_controllers():
    fixed = FixedKLController(0.05)
    assert fixed.update(10.0, 1000) == 0.05
    c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    assert c.update(2.0, n_samples=10) == pytest.approx(0.1 * 1.02)  # error clipped to +0.2
    assert c.update(0.9, n_samples=100) == pytest.approx(0.1 * 1.02 * 0.9)  # error -0.1, full horizon
    assert isinstance(make_kl_controller(KLConfig(coef=0.1, controller="adaptive")), AdaptiveKLController)
    assert isinstance(make_kl_controller(KLConfig()), FixedKLController)
    with pytest.raises(ValueError, match=r"coef \(0.0\) must be > 0"):
        AdaptiveKLController(0.0, 1.0, 10)


def test_k3_is_bounded_in_both_tails():
    # log(ref/pi) = -50 (pi far above ref): -1 - (-20 after the clamp) = 19, bounded to 10.
    # log(ref/pi) = +30 (ref far above pi): e^20 - 21 ~ 4.9e8, bounded to 10.
    lp = torch.tensor([[0.0, -40.0, -1.0]])
    ref = torch.tensor([[-50.0, -10.0, -1.5]])
    k3 = KL_ESTIMATORS["k3"](lp, ref)
    assert k3[0, 0].item() == K3_BOUND and k3[0, 1].item() == K3_BOUND
    assert k3[0, 2].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)  # inside: untouched
