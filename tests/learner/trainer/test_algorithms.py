"""PolicyTrainer on a tiny model: the algorithm section, wired.

All engines share one gloo process group in this process (DeepSpeed allows re-initialising
engines on it). Losses, corrections, aggregation modes, KL and entropy trained with micro batches
of 5 sequences (or packed ones) must land on the same weights as plain-torch AdamW steps on the
whole batch at once; so must per-group importance weights. The behaviour weights, the KL to the
reference (its controller, as a reward penalty, the reference in its own process), masked
importance sampling, the log-linear proximal policy and ReMax's baseline are checked by what
they report and train.
"""

import math

import numpy as np
import pytest
import torch

from asyncrl.learner.advantages import grpo_advantages
from asyncrl.learner.batch import collate, token_logprobs
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.losses import decoupled_ppo_loss
from asyncrl.learner.trainer import PolicyTrainer
from asyncrl.wire.schema import Group, Sample
from tests.learner.trainer.steps import ALGORITHMS, GRAD_CLIP, LR, config, make_groups, plain_torch_steps

pytestmark = pytest.mark.slow  # DeepSpeed engines at every ZeRO stage


def test_behaviour_weights_are_one_when_behaviour_is_the_model(model_dir, hf_state, groups):
    temperature = 0.7
    model, _ = hf_state
    own = []
    for group in groups:
        samples = []
        for s in group.samples:
            ids = torch.from_numpy(np.concatenate([group.prompt_ids, s.response_ids]).astype(np.int64))[None]
            with torch.no_grad():
                lp = token_logprobs(model(input_ids=ids).logits, ids, temperature)[0, len(group.prompt_ids) - 1 :]
            samples.append(Sample(s.uid, s.response_ids, lp.numpy().astype(np.float32), "", "stop", s.reward))
        own.append(Group(group.group_id, group.prompt_uid, "t", "", "", group.prompt_ids, 0, "gen", samples))
    trainer = PolicyTrainer(model_dir, config(0, temperature=temperature))
    stats = trainer.train_step(own)
    assert stats.is_weight_mean == pytest.approx(1.0, abs=1e-5)
    assert stats.is_weight_max == pytest.approx(1.0, abs=1e-5)
    assert stats.is_weight_ess == pytest.approx(1.0, abs=1e-6)
    assert stats.behaviour_ess == pytest.approx(1.0, abs=1e-6)
    assert stats.behaviour_kl_by_staleness == {0: pytest.approx(0.0, abs=1e-6)}
    assert stats.masked_frac == 0.0
    assert stats.behaviour_kl == pytest.approx(0.0, abs=1e-6)
    assert stats.mismatch_kl == pytest.approx(0.0, abs=1e-6)  # staleness 0: all tokens count


def test_importance_weights_scale_each_groups_token_loss(model_dir, groups):
    """train_step(groups, weights) is one step on sum_g w_g * (group g's token losses) / tokens,
    checked against plain torch computing that loss group by group."""
    from transformers import AutoModelForCausalLM

    weights = [1.0, 0.5, 0.0, 2.0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    lp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
    total = batch.response_mask.sum()
    loss = 0.0
    for g, w in enumerate(weights):
        mask = batch.response_mask * (batch.group_index == g).float()[:, None]  # (B, T): group g only
        group_loss, _ = decoupled_ppo_loss(lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, mask)
        loss = loss + w * group_loss * mask.sum() / total
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item()
    optimizer.step()

    trainer = PolicyTrainer(model_dir, config(0))
    stats = trainer.train_step(groups, weights=weights)
    assert stats.grad_norm == pytest.approx(grad_norm, rel=1e-4)
    after = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0)
    assert trainer.train_batch(groups, weights=weights).advantages[batch.group_index == 2].abs().sum() == 0
    with pytest.raises(ValueError, match=r"weights has 3 entries, must have one per group \(4\)"):
        trainer.train_step(groups, weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        trainer.train_step(groups, weights=[1.0, -1.0, 1.0, 1.0])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithms_in_micro_batches_match_plain_torch(name, model_dir, groups):
    """Losses, corrections, aggregation modes, KL and entropy through DeepSpeed in micro batches of
    5 sequences land on the same weights as plain torch on the whole batch."""
    algo = AlgorithmConfig(**ALGORITHMS[name])
    expected = plain_torch_steps(model_dir, groups, algo)
    trainer = PolicyTrainer(model_dir, config(0), algo)
    for _ in range(2):
        stats = trainer.train_step(groups)
        assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)
        assert stats.masked_frac > 0 or algo.rejection == "none"  # the rejections drop some tokens
    after = trainer.full_state_dict()
    for key, tensor in expected.items():
        torch.testing.assert_close(after[key], tensor, atol=1e-4, rtol=0)


@pytest.mark.parametrize("stage", [0, 2])
def test_packed_micro_batches_land_on_the_same_weights(stage, model_dir, groups, reference_weights):
    """Micro batches of 24 token slots, several sequences per row: the same two steps as plain
    torch on the whole padded batch, with no more padding computed than padded micro batches."""
    trainer = PolicyTrainer(model_dir, config(stage, micro_batch_tokens=24))
    stats = [trainer.train_step(groups) for _ in range(2)]
    weights, grad_norms = reference_weights
    assert [s.grad_norm for s in stats] == pytest.approx(grad_norms, rel=1e-4)
    for name, tensor in trainer.full_state_dict().items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0)
    padded = PolicyTrainer(model_dir, config(stage)).train_step(groups)
    assert 0 <= stats[0].padding_frac <= padded.padding_frac < 1


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_packed_sequence_level_losses_match_plain_torch(name, model_dir, groups):
    """Sequence-level ratios (GSPO), sequence-level corrections and aggregations, KL and entropy
    with packed micro batches: the per-token results are unpacked to one sequence per row before
    the loss, so the loss is the padded one exactly."""
    algo = AlgorithmConfig(**ALGORITHMS[name])
    expected = plain_torch_steps(model_dir, groups, algo)
    trainer = PolicyTrainer(model_dir, config(0, micro_batch_tokens=30), algo)
    for _ in range(2):
        trainer.train_step(groups)
    after = trainer.full_state_dict()
    for key, tensor in expected.items():
        torch.testing.assert_close(after[key], tensor, atol=1e-4, rtol=0)


def test_kl_to_the_reference_and_the_adaptive_controller(model_dir, groups):
    algo = AlgorithmConfig(kl={"coef": 0.2, "controller": "adaptive", "target": 1e-6, "horizon": 16})
    trainer = PolicyTrainer(model_dir, config(0), algo)
    first = trainer.train_step(groups)
    assert first.ref_kl == pytest.approx(0.0, abs=1e-7) and first.kl_coef == pytest.approx(0.2)
    second = trainer.train_step(groups)
    assert second.ref_kl > 0
    assert second.kl_coef == pytest.approx(0.2 * (1 - 0.2))  # KL 0 < target: -20% over 16 samples
    assert trainer.kl_controller.value == pytest.approx(0.2 * 0.8 * 1.2)  # KL >> target: +20%
    # first step: every sample fresh -> mismatch KL defined; second: all stale -> NaN
    assert first.mismatch_kl >= 0 and math.isnan(second.mismatch_kl)


def test_kl_as_reward_penalty_changes_the_advantages(model_dir, groups):
    fixed = PolicyTrainer(
        model_dir, config(0), AlgorithmConfig(kl={"coef": 1.0, "use_in": "reward", "estimator": "k1"})
    )
    stats = fixed.train_step(groups)
    assert math.isfinite(stats.loss) and stats.kl_coef == 1.0
    # mu (the groups' logprobs) is not the reference, so the penalised rewards differ per sample
    plain = PolicyTrainer(model_dir, config(0))
    assert stats.loss != pytest.approx(plain.train_step(groups).loss)


def test_masked_importance_sampling_reports_the_masked_fraction(model_dir, groups):
    trainer = PolicyTrainer(model_dir, config(0), AlgorithmConfig(correction="mis", mis_low=0.9, mis_high=1.1))
    stats = trainer.train_step(groups)
    assert 0 < stats.masked_frac < 1 and stats.is_weight_ess < 1


def test_log_linear_proximal_equals_recompute_with_one_step_per_batch(model_dir, groups):
    stale = make_groups(32, policy_version=0, seed=0)
    for g in stale:  # sampled 3 versions before the learner's
        g.policy_version = -3
    a = PolicyTrainer(model_dir, config(0), AlgorithmConfig(proximal="log_linear"))
    b = PolicyTrainer(model_dir, config(0), AlgorithmConfig(proximal="recompute"))
    sa, sb = a.train_step(stale), b.train_step(stale)
    assert sa.loss == pytest.approx(sb.loss, rel=1e-6) and sa.staleness == [3] * 16
    wa, wb = a.full_state_dict(), b.full_state_dict()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key])


def test_a_reference_in_its_own_process_trains_exactly_like_a_colocated_one(model_dir, groups, tmp_path):
    """algorithm.kl.reference: process — the real reference process, asked over ZeroMQ."""
    from asyncrl.config import RunConfig
    from tests.integration.harness import Harness

    kl = {"coef": 0.2, "controller": "adaptive", "target": 1e-6, "horizon": 16}
    h = Harness(tmp_path, RunConfig(algorithm={"kl": {**kl, "reference": "process"}}))
    try:
        h.start("reference", "reference", model_dir=str(model_dir))
        h.wait_for("reference", "ready", timeout=120)
        remote = PolicyTrainer(
            model_dir, config(0), AlgorithmConfig(kl={**kl, "reference": "process"}), h.endpoints.reference
        )
        remote_stats = [remote.train_step(groups) for _ in range(2)]
        served = h.stop(["reference"], ["reference"])["reference"].served
    finally:
        h.close()
    local = PolicyTrainer(model_dir, config(0), AlgorithmConfig(kl=kl))
    local_stats = [local.train_step(groups) for _ in range(2)]
    assert served == 2 * sum(len(g.samples) for g in groups)
    for r, c in zip(remote_stats, local_stats):
        assert r.ref_kl == pytest.approx(c.ref_kl, abs=1e-7) and r.kl_coef == c.kl_coef
        assert r.loss == pytest.approx(c.loss, rel=1e-6, abs=1e-8)
    with pytest.raises(ValueError, match="needs the reference process's address"):
        PolicyTrainer(model_dir, config(0), AlgorithmConfig(kl={**kl, "reference": "process"}))


def test_remax_uses_each_groups_greedy_reward_as_baseline(model_dir, groups):
    trainer = PolicyTrainer(model_dir, config(0), AlgorithmConfig(adv_estimator="remax"))
    for g in groups:
        g.greedy_reward = 1.0
    try:
        rows = trainer.advantages(groups)
        for g, row in zip(groups, rows):
            np.testing.assert_allclose(row, [s.reward - 1.0 for s in g.samples])
        assert math.isfinite(trainer.train_step(groups).loss)
        groups[0].greedy_reward = None
        with pytest.raises(ValueError, match="greedy_reward"):
            trainer.advantages(groups)
    finally:
        for g in groups:
            g.greedy_reward = None
