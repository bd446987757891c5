"""What the trainer's test modules share besides their fixtures: the test batch (``make_groups``),
the trainer config every stage uses, the plain-torch steps the trainer must reproduce, the
algorithm matrix and truncated copies of a batch."""

import copy

import numpy as np
import torch

from asyncrl.learner.advantages import ADV_ESTIMATORS
from asyncrl.learner.batch import collate, token_logprobs
from asyncrl.learner.kl import KL_ESTIMATORS
from asyncrl.learner.losses import LOSS_AGG_MODES, compute_policy_loss
from asyncrl.learner.trainer import TrainerConfig
from asyncrl.wire.schema import Group, Sample

torch.set_num_threads(1)

LR = 1e-3
GRAD_CLIP = 0.5  # the test batch's gradient norm is ~1, so clipping is exercised


def make_groups(vocab_size, policy_version=0, num_groups=4, group_size=4, seed=0):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        for i in range(group_size):
            T = int(rng.integers(3, 8))
            samples.append(
                Sample(
                    uid=f"g{g}/{i}",
                    response_ids=rng.integers(3, vocab_size, size=T).astype(np.int32),
                    # ~ uniform sampler, a little off the tiny model: weights near but not at 1
                    logprobs=(-np.log(vocab_size) + 0.2 * rng.standard_normal(T)).astype(np.float32),
                    text="",
                    finish_reason="stop",
                    reward=float(i % 2) if g % 2 == 0 else float(i == 0),  # never a constant group
                )
            )
        prompt = rng.integers(3, vocab_size, size=int(rng.integers(2, 6))).astype(np.int32)
        groups.append(Group(f"g{g}", f"p{g}", "t", "", "", prompt, policy_version, "gen", samples))
    return groups


def config(stage, **overrides):
    return TrainerConfig(zero_stage=stage, lr=LR, grad_clip=GRAD_CLIP, micro_batch_size=5, **overrides)


ALGORITHMS = {
    "cispo_tis_seq_rloo": dict(
        adv_estimator="rloo",
        policy_loss="cispo",
        correction="tis",
        correction_level="sequence",
        is_cap=2.0,
        loss_agg_mode="seq-mean-token-mean",
    ),
    "gspo_mis_reinforce_pp_kl_entropy": dict(
        adv_estimator="reinforce_pp_baseline",
        policy_loss="gspo",
        correction="mis",
        correction_level="sequence",
        mis_low=0.2,
        mis_high=3.0,
        clip_low=0.05,
        clip_high=0.08,
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_norm_tokens=8,
        kl={"coef": 0.5, "estimator": "k2"},
        entropy_coef=0.01,
    ),
    "sapo_opo_tis_token_sum_entropy": dict(
        adv_estimator="opo",
        policy_loss="sapo",
        correction="tis",
        is_cap=2.0,
        rejection="token_k3",
        rejection_threshold=0.02,
        is_batch_normalise=True,
        loss_agg_mode="token-sum",
        entropy_coef=0.01,
    ),
    "gmpo_pass_at_k_kl_token_mean": dict(
        adv_estimator="pass_at_k",
        pass_k=2,
        policy_loss="gmpo",
        clip_low=0.4,
        clip_high=0.4,
        correction="mis",
        correction_level="sequence",
        mis_low=0.2,
        mis_high=3.0,
        rejection="seq_max_k2",
        rejection_threshold=0.1,
        is_batch_normalise=True,
        loss_agg_mode="seq-mean-token-mean",
        kl={"coef": 0.5, "estimator": "k3"},
        kl_entropy_agg_mode="token-mean",
    ),
    "dapo_dual_clip_behaviour_ppo": dict(
        adv_estimator="dr_grpo",
        correction="behaviour_ppo",
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        loss_agg_mode="seq-mean-token-sum",
    ),
}


def plain_torch_steps(model_dir, groups, algo, steps=2):
    """``steps`` plain-torch AdamW steps of ``algo`` on the whole batch at once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups], dtype=np.float32)
    lengths = np.array([[len(s.response_ids) for s in g.samples] for g in groups])
    advantages = ADV_ESTIMATORS[algo.adv_estimator](rewards, lengths=lengths, k=algo.pass_k)
    batch = collate(groups, advantages, pad_id=0)
    mask = batch.response_mask
    regulariser_agg = LOSS_AGG_MODES[algo.kl_entropy_agg_mode or algo.loss_agg_mode]
    for _ in range(steps):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = token_logprobs(logits, batch.input_ids)
        loss, _ = compute_policy_loss(
            lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, mask, algo, norm_tokens=algo.loss_norm_tokens
        )
        if algo.kl.coef > 0:
            ref_lp = token_logprobs(
                ref(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
            )
            kl = KL_ESTIMATORS[algo.kl.estimator](lp, ref_lp)
            loss = loss + algo.kl.coef * regulariser_agg(kl, mask, norm_tokens=algo.loss_norm_tokens)
        if algo.entropy_coef > 0:
            z = logits[:, :-1]
            entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
            loss = loss - algo.entropy_coef * regulariser_agg(entropy, mask, norm_tokens=algo.loss_norm_tokens)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def with_truncated(groups, cut=((0, 1), (1, 0), (1, 3), (3, 2))):
    """A copy of ``groups`` whose samples ``(group, index)`` in ``cut`` stopped at the length limit."""
    out = copy.deepcopy(groups)
    for g, i in cut:
        out[g].samples[i].finish_reason = "length"
    return out
