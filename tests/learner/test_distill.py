"""On-policy distillation's per-token advantage, against the formula worked by hand."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from asyncrl.config import RunConfig
from asyncrl.learner.batch import collate
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.distill import add_distillation, distill_advantages, teacher_rows
from tests.factories import make_group


def test_the_advantage_is_the_teacher_logprob_less_the_behaviour_logprob():
    teacher = torch.tensor([[-0.1, -2.0, -0.7], [-1.0, -1.0, 0.0]])
    mu = torch.tensor([[-0.5, -0.5, -0.7], [-3.0, -0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # A_t = coef * (log pi_T - log mu): 0.4, -1.5, 0 ; 2.0, -0.8, (masked) 0; times 0.5
    out = distill_advantages(teacher, mu, mask, coef=0.5)
    assert out.flatten().tolist() == pytest.approx([0.2, -0.75, 0.0, 1.0, -0.4, 0.0])


def test_clip_bounds_each_tokens_log_ratio_before_the_coefficient():
    out = distill_advantages(torch.tensor([[-9.0, -0.1]]), torch.tensor([[-0.1, -4.1]]), torch.ones(1, 2), 2.0, 1.0)
    assert out[0].tolist() == pytest.approx([-2.0, 2.0])  # -8.9 -> -1, +4 -> +1, times 2


def test_the_baseline_is_the_mean_log_ratio_over_trained_tokens():
    teacher = torch.tensor([[-1.0, -2.0, -9.0]])
    mu = torch.tensor([[-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # log-ratios -0.5, -1.5 (the third masked): mean -1.0
    out = distill_advantages(teacher, mu, mask, coef=2.0, baseline=True)
    assert out[0].tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="must have one shape"):
        distill_advantages(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def _taught(group, values):
    for sample, v in zip(group.samples, values):
        sample.teacher_logprobs = np.asarray(v, dtype=np.float32)
        sample.reward = 1.0 if sample.uid.endswith("0") else 0.0
    return group


def test_teacher_rows_sit_where_collate_puts_the_behaviour_logprobs():
    group = _taught(make_group("g", n=2, length=3), [[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0]])
    batch = collate([group], [[0.0, 0.0]], pad_id=0)
    rows = teacher_rows([group], batch.behaviour_logprobs.shape[1])
    # prompt of 3 tokens: response token j is predicted from position 2 + j
    assert rows[0].tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2, -0.3])
    assert ((rows != 0) == (batch.response_mask != 0)).all()


def test_a_sample_without_teacher_logprobs_is_named():
    group = make_group("g", n=2, rewards=[1.0, 0.0])
    with pytest.raises(ValueError, match="g/0: no teacher_logprobs"):
        teacher_rows([group], 5)


@pytest.mark.parametrize("with_rewards", [True, False])
def test_added_to_the_rewards_advantages_or_alone_weighted_per_group(with_rewards):
    g0 = _taught(make_group("g0", n=2, length=2), [[-0.5, -1.5], [-0.5, -0.5]])  # mu is -0.5 everywhere
    g1 = _taught(make_group("g1", n=2, length=2), [[-0.5, -0.5], [0.0, -0.5]])
    batch = collate([g0, g1], [[1.0, -1.0], [0.5, -0.5]], pad_id=0)
    algo = AlgorithmConfig(distill={"coef": 2.0, "rewards": with_rewards})
    add_distillation(algo, batch, [g0, g1], weights=[1.0, 3.0])
    mask = batch.response_mask
    got = [row[m > 0].tolist() for row, m in zip(batch.advantages, mask)]
    rl = [1.0, -1.0, 0.5, -0.5] if with_rewards else [0.0] * 4
    # per token: 2 * w_g * (teacher + 0.5)
    term = [[0.0, -2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 0.0]]
    assert got == [pytest.approx([a + t for t in row]) for a, row in zip(rl, term)]


def test_off_without_the_option():
    group = make_group("g", n=2, rewards=[1.0, 0.0])
    batch = collate([group], [[1.0, -1.0]], pad_id=0)
    before = batch.advantages.clone()
    add_distillation(AlgorithmConfig(), batch, [group])  # no teacher_logprobs needed
    assert torch.equal(before, batch.advantages)


def test_the_config_refuses_what_cannot_run():
    with pytest.raises(ValidationError, match="gmpo"):
        AlgorithmConfig(distill={}, policy_loss="gmpo", clip_low=0.4, clip_high=0.4)
    with pytest.raises(ValidationError, match="critic"):
        AlgorithmConfig(distill={"rewards": False}, adv_estimator="gae", critic={})
    with pytest.raises(ValidationError, match="coef"):
        AlgorithmConfig(distill={"coef": 0})
    with pytest.raises(ValidationError, match="kind teacher in \\['reward.rewards'\\]"):
        RunConfig(algorithm={"distill": {}})
