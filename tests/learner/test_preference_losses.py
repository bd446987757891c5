"""The preference losses against values computed by hand from their papers' formulas."""

import math

import pytest
import torch

from asyncrl.learner.preference_losses import PREFERENCE_LOSSES, preference_loss


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# Two pairs. Pair 0: the policy moved toward the chosen answer (h = 2); pair 1: toward the rejected (h = -0.5).
POLICY_CHOSEN = torch.tensor([-1.0, -4.0])
POLICY_REJECTED = torch.tensor([-3.0, -2.5])
REF_CHOSEN = torch.tensor([-2.0, -3.0])
REF_REJECTED = torch.tensor([-2.0, -2.0])
MARGINS = [2.0, -0.5]  # (pc - rc) - (pr - rr)
BETA = 0.1


def losses(loss_type: str, **kw) -> list[float]:
    out = preference_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, BETA, loss_type, **kw)
    return out.losses.tolist()


def test_dpo_sigmoid_is_minus_log_sigmoid_of_beta_margin():
    assert losses("sigmoid") == pytest.approx([-log_sigmoid(BETA * h) for h in MARGINS], rel=1e-6)


def test_conservative_dpo_mixes_the_flipped_label():
    eps = 0.2
    want = [-(1 - eps) * log_sigmoid(BETA * h) - eps * log_sigmoid(-BETA * h) for h in MARGINS]
    assert losses("sigmoid", label_smoothing=eps) == pytest.approx(want, rel=1e-6)


def test_ipo_regresses_the_margin_onto_half_inverse_beta():
    assert losses("ipo") == pytest.approx([(h - 1 / (2 * BETA)) ** 2 for h in MARGINS], rel=1e-6)


def test_hinge_is_zero_past_the_margin():
    assert losses("hinge") == pytest.approx([max(0.0, 1 - BETA * h) for h in MARGINS], rel=1e-6)
    big = preference_loss(
        torch.tensor([0.0]), torch.tensor([-20.0]), torch.tensor([0.0]), torch.tensor([0.0]), 0.1, "hinge"
    )
    assert big.losses.tolist() == [0.0]


def test_implicit_rewards_accuracy_and_margin():
    out = preference_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, BETA)
    assert out.chosen_rewards.tolist() == pytest.approx([0.1, -0.1])
    assert out.rejected_rewards.tolist() == pytest.approx([-0.1, -0.05])
    assert out.accuracy == 0.5
    assert out.margin == pytest.approx(BETA * sum(MARGINS) / 2)


@pytest.mark.parametrize("loss_type", sorted(PREFERENCE_LOSSES))
def test_gradient_flows_to_the_policy_only(loss_type):
    chosen = POLICY_CHOSEN.clone().requires_grad_(True)
    rejected = POLICY_REJECTED.clone().requires_grad_(True)
    ref = REF_CHOSEN.clone().requires_grad_(True)
    out = preference_loss(chosen, rejected, ref, REF_REJECTED, BETA, loss_type)
    out.losses.sum().backward()
    assert ref.grad is None
    # Where the loss is active, raising the chosen answer's log-probability lowers it.
    assert (chosen.grad[0] <= 0) and (rejected.grad[0] >= 0)


def test_sigmoid_gradient_matches_the_paper():
    # DPO eq. 8: d/d logpi(y_w) of the loss is -beta * sigma(-beta h).
    chosen = POLICY_CHOSEN.clone().requires_grad_(True)
    preference_loss(chosen, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, BETA).losses.sum().backward()
    want = [-BETA / (1 + math.exp(BETA * h)) for h in MARGINS]
    assert chosen.grad.tolist() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"loss_type": "kto"}, "loss_type 'kto' is not one of"),
        ({"beta": 0.0}, "beta (0.0) must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing (0.5) must be in [0, 0.5)"),
    ],
)
def test_bad_options_name_the_value_and_rule(kw, message):
    args = {"beta": BETA, **kw}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        preference_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, **args)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one shape"):
        preference_loss(POLICY_CHOSEN, POLICY_REJECTED[:1], REF_CHOSEN, REF_REJECTED, BETA)
