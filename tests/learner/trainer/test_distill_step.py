"""On-policy distillation through the trainer: the per-token reverse-KL advantage, alone or added to
GRPO's, trains the same weights as plain torch computing it by hand, and moves the policy toward
the teacher."""

import copy

import numpy as np
import pytest
import torch

from asyncrl.learner.advantages import grpo_advantages
from asyncrl.learner.batch import collate, token_logprobs
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.losses import compute_policy_loss
from asyncrl.learner.trainer import PolicyTrainer
from tests.learner.trainer.steps import GRAD_CLIP, LR, config

pytestmark = pytest.mark.slow  # DeepSpeed engines


def taught(groups, seed=1):
    """``groups`` with teacher logprobs: the behaviour's, plus a margin of N(0, 1) per token (clipped to <= 0)."""
    rng = np.random.default_rng(seed)
    out = copy.deepcopy(groups)
    for g in out:
        for s in g.samples:
            s.teacher_logprobs = np.minimum(s.logprobs + rng.standard_normal(len(s.logprobs)), 0).astype(np.float32)
    return out


def plain_torch(model_dir, groups, algo, steps=2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups], dtype=np.float32)
    rl = grpo_advantages(rewards) if algo.distill.rewards else np.zeros_like(rewards)
    batch = collate(groups, rl, pad_id=0)
    teacher = torch.zeros_like(batch.behaviour_logprobs)  # by hand: row b, token j at P - 1 + j
    rows = [(len(g.prompt_ids), s.teacher_logprobs) for g in groups for s in g.samples]
    for b, (P, values) in enumerate(rows):
        teacher[b, P - 1 : P - 1 + len(values)] = torch.from_numpy(values)
    advantages = batch.advantages + algo.distill.coef * (teacher - batch.behaviour_logprobs) * batch.response_mask
    for _ in range(steps):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = token_logprobs(logits, batch.input_ids)
        loss, _ = compute_policy_loss(lp, lp.detach(), batch.behaviour_logprobs, advantages, batch.response_mask, algo)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("with_rewards", [False, True])
def test_distillation_trains_what_plain_torch_computes_by_hand(model_dir, groups, with_rewards):
    groups = taught(groups)
    algo = AlgorithmConfig(distill={"coef": 0.5, "rewards": with_rewards})
    expected = plain_torch(model_dir, groups, algo)
    trainer = PolicyTrainer(model_dir, config(0), algo)  # micro batches of 5 sequences
    for _ in range(2):
        trainer.train_step(groups)
    after = trainer.full_state_dict()
    for key, tensor in expected.items():
        torch.testing.assert_close(after[key], tensor, atol=1e-4, rtol=0)


def test_distillation_alone_moves_the_policy_toward_the_teacher(model_dir, groups):
    groups = taught(groups)
    algo = AlgorithmConfig(distill={"coef": 1.0, "rewards": False})
    trainer = PolicyTrainer(model_dir, config(0), algo)
    batch = collate(groups, np.zeros((len(groups), len(groups[0].samples))), pad_id=0)
    mask = batch.response_mask > 0

    def policy_logprobs():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.load_state_dict(trainer.full_state_dict())
        with torch.no_grad():
            return token_logprobs(
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
            )

    before = policy_logprobs()
    for _ in range(3):
        trainer.train_step(groups)
    moved = (policy_logprobs() - before)[mask]
    margin = torch.cat([torch.from_numpy(s.teacher_logprobs - s.logprobs) for g in groups for s in g.samples])
    # the tokens the teacher prefers rose more than those it does not
    assert moved[margin > 0.5].mean() > moved[margin < -0.5].mean()
