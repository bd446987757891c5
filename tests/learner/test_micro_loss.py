"""The entropy bonus and the KL term of a micro batch's loss are aggregated like the policy loss
(``algorithm.kl_entropy_agg_mode``, None: ``loss_agg_mode``), over the mini-batch's normalisers."""

from types import SimpleNamespace

import pytest
import torch

from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.step import micro_loss


def loss_terms(algo: AlgorithmConfig, entropy: torch.Tensor, kl_as_logprobs: torch.Tensor) -> float:
    """micro_loss minus its policy loss: the entropy and KL terms, on a (2, 3) micro batch whose
    logprobs are all 0 and whose reference gives ``kl_as_logprobs`` (k1: KL = -ref)."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    micro = SimpleNamespace(
        response_mask=mask,
        behaviour_logprobs=torch.zeros(2, 3),
        advantages=torch.zeros(2, 3),
        policy_version=torch.zeros(2, dtype=torch.long),
    )
    step = SimpleNamespace(
        proximal=None, ref=-kl_as_logprobs, beta=1.0, norm_tokens=4, version_before=0, weight_totals=None
    )
    scores = SimpleNamespace(logprobs=torch.zeros(2, 3, requires_grad=True), entropy=entropy)
    plan = SimpleNamespace(lo=0, hi=2)
    loss, policy_loss, *_ = micro_loss(algo, step, plan, micro, scores, total_tokens=8, num_seqs=4)
    return float((loss - policy_loss).detach())


@pytest.mark.parametrize(
    "mode, agg",
    [
        ("token-mean", 10 / 8),  # sum over tokens / the mini-batch's 8 tokens
        ("token-sum", 10.0),
        ("seq-mean-token-sum", (6 + 4) / 4),  # / the mini-batch's 4 sequences
        ("seq-mean-token-mean", (2 + 4) / 4),
        ("seq-mean-token-sum-norm", 10 / (4 * 4)),
    ],
)
def test_entropy_and_kl_follow_the_loss_aggregation(mode, agg):
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])  # 9s are padding
    zero = torch.zeros(2, 3)
    entropy_only = AlgorithmConfig(loss_agg_mode=mode, entropy_coef=0.5)
    assert loss_terms(entropy_only, values, zero) == pytest.approx(-0.5 * agg)
    kl_only = AlgorithmConfig(loss_agg_mode=mode, kl={"coef": 1.0, "estimator": "k1"})
    assert loss_terms(kl_only, zero, values) == pytest.approx(agg)
    # a stated key overrides: token-mean whatever the policy loss does (the earlier behaviour)
    stated = AlgorithmConfig(loss_agg_mode=mode, kl_entropy_agg_mode="token-mean", entropy_coef=0.5)
    assert loss_terms(stated, values, zero) == pytest.approx(-0.5 * 10 / 8)
