"""A whole learner step with a KL reference and with a critic: packed micro batches give the same
figures and weights as padded ones, with the reference's and the critic's forwards on packed rows.

Two steps each way from the same start (the first step's KL is 0 and its value head is 0: the
second step is where a layout error would show), under the attention implementations this
machine runs (sdpa, eager).
"""

import math

import pytest
import torch

from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.trainer import PolicyTrainer
from tests.learner.trainer.steps import config

pytestmark = pytest.mark.slow  # DeepSpeed engines

TOKENS = 30
"""The packed micro batches' token budget: two or three sequences to a row."""
FIGURES = (
    "loss",
    "policy_loss",
    "entropy",
    "grad_norm",
    "ref_kl",
    "kl_coef",
    "value_loss",
    "value_mean",
    "return_mean",
)

CASES = {
    "kl-loss": dict(kl={"coef": 0.2, "use_in": "loss", "estimator": "k3"}),
    "gae-kl-reward": dict(adv_estimator="gae", critic={"lr": 1e-3}, kl={"coef": 0.1, "use_in": "reward"}),
    "vtrace-kl-loss": dict(adv_estimator="gae", critic={"lr": 1e-3, "targets": "vtrace"}, kl={"coef": 0.1}),
}


def rows_seen(model: torch.nn.Module) -> list[int]:
    seen: list[int] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(len(kw["input_ids"])), with_kwargs=True)
    return seen


def two_steps(model_dir, groups, algo, attn, micro_batch_tokens):
    trainer = PolicyTrainer(model_dir, config(0, micro_batch_tokens=micro_batch_tokens, attn_implementation=attn), algo)
    models = {"reference": trainer.reference.model}
    if trainer.critic is not None:
        models["critic"] = trainer.critic.engine.module.backbone
    for name, model in models.items():
        assert model.config._attn_implementation == attn, name
    assert trainer.engine.module.config._attn_implementation == attn
    rows = {name: rows_seen(model) for name, model in models.items()}
    stats = [trainer.train_step(groups) for _ in range(2)]
    return stats, trainer.full_state_dict(), rows


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_step_with_reference_and_critic_equals_the_padded_step(case, attn, model_dir, groups):
    algo = AlgorithmConfig(**CASES[case])
    padded, padded_weights, padded_rows = two_steps(model_dir, groups, algo, attn, None)
    packed, packed_weights, packed_rows = two_steps(model_dir, groups, algo, attn, TOKENS)
    sequences = sum(len(g.samples) for g in groups)
    for name, rows in packed_rows.items():  # the reference and the critic ran on packed rows
        assert 0 < sum(rows) < sum(padded_rows[name]), name
    assert sum(padded_rows["reference"]) == 2 * sequences
    assert packed[1].ref_kl > 0 and (algo.adv_estimator != "gae" or packed[1].value_mean != 0)
    for a, b in zip(packed, padded):
        for figure in FIGURES:
            x, y = getattr(a, figure), getattr(b, figure)
            if y is None or (isinstance(y, float) and math.isnan(y)):
                assert x is None or math.isnan(x), figure
                continue
            assert x == pytest.approx(y, rel=1e-4, abs=1e-6), figure
    assert packed[0].padding_frac <= padded[0].padding_frac
    for name, tensor in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], tensor, rtol=0, atol=1e-5, msg=name)
