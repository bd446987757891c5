"""Rejection masks on the train/behaviour log-ratio and batch-normalised importance weights, by hand."""

import math

import pytest
import torch

from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.losses import batch_weight_sums, compute_policy_loss
from asyncrl.learner.rejection import REJECTIONS, batch_normalised_weights, k2_divergence, k3_divergence

ln = math.log

# row 0: log r = 0, ln 2, ln 0.5; row 1: 0.1, 0.1 and a padding token far off (never counted)
LOG_RATIO = torch.tensor([[0.0, ln(2.0), ln(0.5)], [0.1, 0.1, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_k2_and_k3_by_hand():
    torch.testing.assert_close(k2_divergence(LOG_RATIO[0]), torch.tensor([0.0, ln(2) ** 2 / 2, ln(2) ** 2 / 2]))
    # k3 = r - 1 - log r: r = 2 -> 1 - ln 2; r = 0.5 -> ln 2 - 0.5
    torch.testing.assert_close(k3_divergence(LOG_RATIO[0]), torch.tensor([0.0, 1 - ln(2), ln(2) - 0.5]))


@pytest.mark.parametrize(
    "name, threshold, keep",
    [
        # k2 = 0, 0.240, 0.240 | 0.005, 0.005
        ("token_k2", 0.1, [[1, 0, 0], [1, 1, 0]]),
        # k3 = 0, 0.307, 0.193 | 0.00517, 0.00517
        ("token_k3", 0.25, [[1, 0, 1], [1, 1, 0]]),
        # mean k3: row 0 (0 + 0.307 + 0.193) / 3 = 0.167, row 1 0.00517
        ("seq_mean_k3", 0.1, [[0, 0, 0], [1, 1, 0]]),
        ("seq_mean_k3", 0.2, [[1, 1, 1], [1, 1, 0]]),
        # max k2: row 0 0.240, row 1 0.005 (the padding's k2 of 40.5 is not counted)
        ("seq_max_k2", 0.2, [[0, 0, 0], [1, 1, 0]]),
        ("seq_max_k2", 0.3, [[1, 1, 1], [1, 1, 0]]),
    ],
)
def test_rejection_masks_by_hand(name, threshold, keep):
    assert REJECTIONS[name](LOG_RATIO, MASK, threshold).tolist() == keep


def test_batch_normalised_weights_have_mean_one_over_the_kept_tokens():
    w = torch.tensor([[1.0, 2.0, 4.0], [1.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # kept tokens 1, 2, 4, 1: mean 2
    torch.testing.assert_close(batch_normalised_weights(w, mask), w / 2)
    # sequence level: one weight per row, 2 and 4 (an empty row is not counted): mean 3
    w = torch.tensor([[2.0, 2.0, 2.0], [4.0, 4.0, 4.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(batch_normalised_weights(w, mask, "sequence"), w / 3)
    torch.testing.assert_close(batch_normalised_weights(torch.zeros(1, 2), torch.ones(1, 2)), torch.zeros(1, 2))


def test_rejection_and_normalisation_in_the_policy_loss():
    prox = torch.full((2, 3), -1.0)
    mu = prox - LOG_RATIO  # log pi_prox - log mu = LOG_RATIO
    lp = prox.clone().requires_grad_(True)
    adv = torch.ones(2, 3)
    algo = AlgorithmConfig(correction="tis", is_cap=2.0, rejection="token_k3", rejection_threshold=0.25)
    loss, parts = compute_policy_loss(lp, prox, mu, adv, MASK, algo)
    assert parts["keep"].tolist() == [[1, 0, 1], [1, 1, 0]]
    # kept weights (min(r, 2)): 1, 0.5, 1.105, 1.105; ratio 1 (one update): loss = -sum(w) / 4
    kept_w = [1.0, 0.5, math.exp(0.1), math.exp(0.1)]
    assert loss.item() == pytest.approx(-sum(kept_w) / 4, rel=1e-6)
    normalised = AlgorithmConfig(**{**algo.model_dump(), "is_batch_normalise": True})
    loss, parts = compute_policy_loss(lp, prox, mu, adv, MASK, normalised)
    assert (parts["weight"] * parts["keep"]).sum().item() == pytest.approx(4.0, rel=1e-6)
    assert loss.item() == pytest.approx(-1.0, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rejection": "seq_mean_k3"}, r"algorithm.rejection 'seq_mean_k3' needs algorithm.rejection_threshold"),
        (
            {"rejection_threshold": 0.1},
            r"algorithm.rejection_threshold \(0.1\) is set but algorithm.rejection is 'none'",
        ),
        ({"rejection": "token_k2", "rejection_threshold": -1.0}, r"rejection_threshold"),
        (
            {"policy_loss": "gspo", "rejection": "token_k3", "rejection_threshold": 0.1},
            r"algorithm.policy_loss 'gspo' is sequence-level: algorithm.rejection 'token_k3' drops single tokens",
        ),
        ({"correction": "none", "is_batch_normalise": True}, r"algorithm.is_batch_normalise needs importance weights"),
    ],
)
def test_config_names_the_keys(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**kwargs)


@pytest.mark.parametrize("correction, level", [("tis", "token"), ("mis", "sequence"), ("decoupled", "token")])
def test_micro_batches_normalised_by_the_batchs_sums_add_up_to_the_batch(correction, level):
    g = torch.Generator().manual_seed(0)
    prox = -torch.rand(6, 4, generator=g) * 3
    mu = prox + 0.5 * torch.randn(6, 4, generator=g)
    lp = (prox + 0.1 * torch.randn(6, 4, generator=g)).requires_grad_(True)
    adv = torch.randn(6, 1, generator=g).expand(6, 4)
    mask = torch.ones(6, 4)
    mask[2, 2:] = 0
    algo = AlgorithmConfig(
        correction=correction, correction_level=level, is_cap=3.0, mis_low=0.1, mis_high=10.0, is_batch_normalise=True
    )
    whole, _ = compute_policy_loss(lp, prox, mu, adv, mask, algo, num_tokens=mask.sum())
    sums = batch_weight_sums(prox, mu, mask, algo)
    parts = [
        compute_policy_loss(
            lp[a:b], prox[a:b], mu[a:b], adv[a:b], mask[a:b], algo, num_tokens=mask.sum(), weight_totals=sums
        )[0]
        for a, b in ((0, 2), (2, 6))
    ]
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-5)
    # each micro batch normalised by its own mean would not add up
    alone = sum(
        compute_policy_loss(lp[a:b], prox[a:b], mu[a:b], adv[a:b], mask[a:b], algo, num_tokens=mask.sum())[0]
        for a, b in ((0, 2), (2, 6))
    )
    assert alone.item() != pytest.approx(whole.item(), rel=1e-3)
