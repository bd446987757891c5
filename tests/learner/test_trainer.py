"""PolicyTrainer on a tiny model: every ZeRO stage, one optimizer step per call, weights out.

All engines share one gloo process group in this process (DeepSpeed allows re-initialising
engines on it). Each stage trains with micro batches of 5 sequences (16 per batch: 5+5+5+1)
and must land on the same weights as a plain-torch AdamW step on the whole batch at once.
"""

import math
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from asyncrl.learner.advantages import grpo_advantages  # noqa: E402
from asyncrl.learner.batch import collate, token_logprobs  # noqa: E402
from asyncrl.learner.losses import decoupled_ppo_loss  # noqa: E402
from asyncrl.learner.trainer import PolicyTrainer, TrainerConfig  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from asyncrl.wire.schema import Group, Sample  # noqa: E402

LR = 1e-3
GRAD_CLIP = 0.5  # the test batch's gradient norm is ~1, so clipping is exercised


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), out)


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


@pytest.fixture(scope="module")
def hf_state(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def groups(hf_state):
    return make_groups(hf_state[0].config.vocab_size)


@pytest.fixture(scope="module")
def reference_weights(model_dir, groups):
    """Two plain-torch AdamW steps on the whole batch at once: what every stage must reproduce.

    Returns the weights after them and the two gradient norms (before clipping).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    grad_norms = []
    for _ in range(2):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = token_logprobs(logits, batch.input_ids)
        loss, _ = decoupled_ppo_loss(lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, batch.response_mask)
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, grad_norms


def config(stage, **overrides):
    return TrainerConfig(zero_stage=stage, lr=LR, grad_clip=GRAD_CLIP, micro_batch_size=5, **overrides)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_steps_at_each_zero_stage(stage, model_dir, hf_state, groups, reference_weights):
    trainer = PolicyTrainer(model_dir, config(stage))
    assert trainer.version == 0
    before = trainer.full_state_dict()
    hf_model, hf_weights = hf_state
    assert list(before) == list(hf_weights)  # same HF names, same order
    for name, tensor in before.items():
        assert tensor.shape == hf_weights[name].shape and tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, hf_weights[name])

    first = trainer.train_step(groups)
    assert trainer.version == 1 and first.version == 1
    assert first.staleness == [0] * 16  # sampled by version 0, trained at version 0
    after_one = trainer.full_state_dict()
    assert any(not torch.equal(after_one[k], before[k]) for k in before), "weights did not change"

    second = trainer.train_step(groups)
    assert trainer.version == 2
    assert second.staleness == [1] * 16 and second.staleness_max == 1
    for stats in (first, second):
        assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
        assert stats.sequences == 16 and stats.tokens == sum(g.num_tokens for g in groups)
        assert stats.step_s > 0 and stats.clipfrac == 0.0
        assert 0.5 < stats.is_weight_mean < 2.0 and stats.is_weight_max >= stats.is_weight_mean
        assert 0 < stats.is_weight_ess <= 1.0 and stats.masked_frac == 0.0
        assert stats.entropy > 0 and stats.behaviour_kl >= 0
        assert 0 < stats.behaviour_ess <= 1.0
    # one staleness per step here: its KL is the step's
    assert list(first.behaviour_kl_by_staleness) == [0] and list(second.behaviour_kl_by_staleness) == [1]
    assert second.behaviour_kl_by_staleness[1] == pytest.approx(second.behaviour_kl, rel=1e-5)

    # 4 micro batches per call, accumulated into ONE optimizer step per call: the gradient is the
    # full batch's token-mean gradient (same norm) and the weights equal two full-batch steps of
    # plain torch (up to float reduction order)
    weights, grad_norms = reference_weights
    assert [first.grad_norm, second.grad_norm] == pytest.approx(grad_norms, rel=1e-4)
    after_two = trainer.full_state_dict()
    for name, tensor in after_two.items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0)
    assert trainer.engine.global_steps == 2


def test_lr_schedule_sets_each_updates_rate_and_reports_it(model_dir, groups):
    """ZeRO-2 (the optimizer wrapped in DeepSpeed's partitions) with linear warm-up and decay:
    the step stats carry each update's rate, and the weights are those of plain torch stepping at
    those rates; the gradient clipping stats say what was clipped."""
    from transformers import AutoModelForCausalLM

    schedule = dict(lr_schedule="linear", lr_warmup_steps=2, lr_decay_steps=4, min_lr_ratio=0.5)
    expected_lrs = [LR * 0.5, LR, LR, LR * 0.75]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    norms = []
    for lr in expected_lrs:
        for group in optimizer.param_groups:
            group["lr"] = lr
        lp = token_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
        loss, _ = decoupled_ppo_loss(lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, batch.response_mask)
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        optimizer.step()

    trainer = PolicyTrainer(model_dir, config(2, **schedule))
    stats = [trainer.train_step(groups) for _ in expected_lrs]
    assert [s.lr for s in stats] == pytest.approx(expected_lrs, rel=1e-12)
    assert trainer.updates == 4
    assert [s.grad_norm for s in stats] == pytest.approx(norms, rel=1e-4)
    for s, norm in zip(stats, norms):
        assert s.grad_clipped == float(norm > GRAD_CLIP)
        assert s.grad_clip_coef == pytest.approx(min(1.0, GRAD_CLIP / norm), rel=1e-4)
    after = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"lr_schedule \(cosine\) needs lr_decay_steps"):
        PolicyTrainer(model_dir, config(0, lr_schedule="cosine"))


@pytest.mark.parametrize("stage", [0, 3])
def test_small_logit_chunks_and_gradient_checkpointing_land_on_the_same_weights(
    stage, model_dir, groups, reference_weights
):
    """Logits 3 tokens at a time (recomputed in the backward, the LM head a ZeRO-3 partitioned
    parameter at stage 3) and every block's activations recomputed: the same two steps as plain
    torch on full logits."""
    trainer = PolicyTrainer(model_dir, config(stage, logits_chunk_tokens=3, gradient_checkpointing=True))
    assert trainer.engine.module.is_gradient_checkpointing
    norms = [trainer.train_step(groups).grad_norm for _ in range(2)]
    weights, grad_norms = reference_weights
    assert norms == pytest.approx(grad_norms, rel=1e-4)
    for name, tensor in trainer.full_state_dict().items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0)


def test_small_zero_buckets_land_on_the_same_weights(model_dir, groups, reference_weights):
    """ZeRO-2 with reduce and all-gather buckets of 1,000 elements (many buckets a step, where the
    default holds the whole model in one): the same two steps as plain torch."""
    trainer = PolicyTrainer(model_dir, config(2, zero_bucket_elements=1000))
    assert trainer.engine.zero_reduce_bucket_size() == 1000
    assert trainer.engine.zero_allgather_bucket_size() == 1000
    norms = [trainer.train_step(groups).grad_norm for _ in range(2)]
    weights, grad_norms = reference_weights
    assert norms == pytest.approx(grad_norms, rel=1e-4)
    for name, tensor in trainer.full_state_dict().items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0)


def test_bf16_step_on_cpu_scores_close_to_fp32_and_trains(model_dir, hf_state, groups):
    model, _ = hf_state
    trainer = PolicyTrainer(model_dir, config(2, dtype="bf16", logits_chunk_tokens=8))
    assert next(trainer.engine.module.parameters()).dtype == torch.bfloat16
    batch = trainer.train_batch(groups)
    with torch.no_grad():
        lp16 = trainer.score(batch.to(trainer.device), entropy=False).logprobs.cpu()
        lp32 = token_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
    mask = batch.response_mask > 0
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16[mask], lp32[mask], rtol=0, atol=0.05)  # bf16 rounding of the weights
    before = trainer.full_state_dict()
    stats = trainer.train_step(groups)
    assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert stats.entropy > 0 and 0.5 < stats.is_weight_mean < 2.0
    after = trainer.full_state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before), "weights did not change"


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


def test_bf16_zero3_step_and_save_pretrained_roundtrip(model_dir, groups, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = PolicyTrainer(model_dir, config(3, dtype="bf16"))
    stats = trainer.train_step(groups)
    assert math.isfinite(stats.loss) and trainer.version == 1
    weights = trainer.full_state_dict()
    assert all(t.dtype == torch.float32 for t in weights.values())

    out = trainer.save_pretrained(tmp_path / "v1")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert next(loaded.parameters()).dtype == torch.float32
    loaded_weights = loaded.state_dict()
    assert list(loaded_weights) == list(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(loaded_weights[name], tensor, atol=0, rtol=0)
    if (model_dir / "tokenizer.json").exists():
        assert AutoTokenizer.from_pretrained(out).pad_token_id == AutoTokenizer.from_pretrained(model_dir).pad_token_id


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"zero_stage \(4\) must be 0, 1, 2 or 3"):
        TrainerConfig(zero_stage=4)
    with pytest.raises(ValueError, match=r"micro_batch_size \(0\) must be >= 1"):
        TrainerConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match=r"micro_batch_tokens \(1\) must be >= 2 or None"):
        TrainerConfig(micro_batch_tokens=1)
    with pytest.raises(ValueError, match=r"top_p \(1.5\) must be in \(0, 1\]"):
        TrainerConfig(top_p=1.5)
    with pytest.raises(ValueError, match=r"logits_chunk_tokens \(0\) must be >= 1"):
        TrainerConfig(logits_chunk_tokens=0)
    with pytest.raises(ValueError, match="extra"):
        TrainerConfig(loss="ppo")  # the loss is algorithm.policy_loss now
    with pytest.raises(ValueError, match="extra"):
        TrainerConfig(learning_rate=1e-3)


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


# --- the algorithm section, wired -------------------------------------------------------------

from asyncrl.learner.advantages import ADV_ESTIMATORS  # noqa: E402
from asyncrl.learner.config import AlgorithmConfig  # noqa: E402
from asyncrl.learner.kl import KL_ESTIMATORS  # noqa: E402
from asyncrl.learner.losses import LOSS_AGG_MODES, compute_policy_loss  # noqa: E402

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


def test_bf16_if_native_trains_in_what_this_cpu_multiplies_natively(model_dir, groups):
    from asyncrl.models.precision import native_bf16

    trainer = PolicyTrainer(model_dir, config(2, dtype="bf16_if_native"))
    want = torch.bfloat16 if native_bf16(cuda=False) else torch.float32
    assert trainer.cfg.dtype == ("bf16" if want == torch.bfloat16 else "fp32")
    assert next(trainer.engine.module.parameters()).dtype == want
    assert math.isfinite(trainer.train_step(groups).loss)


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


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_round_trip_continues_bit_for_bit(stage, model_dir, groups, tmp_path):
    """save_state after one step, load into a fresh trainer: same weights, same optimizer moments
    (Adam's m and v: without them the next update would differ), same version, learning-rate
    schedule position and KL coefficient, and the next steps land on exactly the weights of a run
    that never stopped, at the same learning rates."""
    from asyncrl.learner.config import AlgorithmConfig

    algo = AlgorithmConfig(kl={"coef": 0.05, "controller": "adaptive", "target": 0.01, "horizon": 100})
    cfg = config(stage, lr_schedule="cosine", lr_warmup_steps=1, lr_decay_steps=3, min_lr_ratio=0.1)
    original = PolicyTrainer(model_dir, cfg, algo)
    original.train_step(groups)
    original.save_state(tmp_path / "ckpt")
    saved_coef = original.kl_controller.value
    uninterrupted_lrs = [original.train_step(groups).lr for _ in range(2)]
    uninterrupted = original.full_state_dict()

    resumed = PolicyTrainer(model_dir, cfg, algo)
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.version == 1 and resumed.updates == 1 and resumed.kl_controller.value == saved_coef
    resumed_lrs = [resumed.train_step(groups).lr for _ in range(2)]
    assert resumed.version == 3
    assert resumed_lrs == uninterrupted_lrs == [LR, pytest.approx(LR * (0.1 + 0.9 * 0.5))]
    for name, tensor in resumed.full_state_dict().items():
        assert torch.equal(tensor, uninterrupted[name]), name


def test_load_state_names_a_missing_checkpoint(model_dir, tmp_path):
    trainer = PolicyTrainer(model_dir, config(0))
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        trainer.load_state(tmp_path / "nothing-here")


@pytest.mark.parametrize("stage", [2, 3])
def test_export_of_a_checkpointed_version_equals_the_trainers_weights(stage, tmp_path):
    """A learner checkpoint (any ZeRO stage) exports (``asyncrl export --step``) as the trainer's
    own fp32 weights. Here rather than in tests/models/test_export.py: trainers share this module's
    process group."""
    from transformers import AutoModelForCausalLM

    from asyncrl.cli import main
    from asyncrl.config import RunConfig, dump_config
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    run = tmp_path / "run"
    (run / "config.yaml").parent.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(RunConfig()))
    warm = build_tiny_model(
        TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), run / "model" / "warm"
    )
    trainer = PolicyTrainer(warm, TrainerConfig(zero_stage=stage, lr=1e-3, micro_batch_size=8))
    vocab = AutoModelForCausalLM.from_pretrained(warm).config.vocab_size
    trainer.train_step(make_groups(vocab))
    trainer.save_state(run / "checkpoints" / "v00000001" / "learner")
    expected = trainer.full_state_dict()

    assert main(["export", str(run), str(tmp_path / "out"), "--step", "1"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


# --- truncated answers (algorithm.truncation) -------------------------------------------------

import copy  # noqa: E402

from asyncrl.learner.truncation import overlong_penalty  # noqa: E402

pytestmark = pytest.mark.slow  # DeepSpeed engines at every ZeRO stage


def with_truncated(groups, cut=((0, 1), (1, 0), (1, 3), (3, 2))):
    """A copy of ``groups`` whose samples ``(group, index)`` in ``cut`` stopped at the length limit."""
    out = copy.deepcopy(groups)
    for g, i in cut:
        out[g].samples[i].finish_reason = "length"
    return out


def test_truncation_keep_trains_on_truncated_answers_as_they_are(model_dir, groups):
    cut = with_truncated(groups)
    kept = PolicyTrainer(model_dir, config(0)).train_step(cut)
    plain = PolicyTrainer(model_dir, config(0)).train_step(groups)
    assert kept.truncated_frac == 4 / 16 and plain.truncated_frac == 0.0
    assert kept.loss == plain.loss and kept.grad_norm == plain.grad_norm


@pytest.mark.parametrize("stage", [0, 2])
def test_truncation_mask_takes_truncated_answers_out_of_the_loss_but_not_the_baseline(stage, model_dir, groups):
    """mask: one step equals plain torch on the loss mask without the truncated rows, with the
    advantages computed over every sample of each group. The last micro batch (row 15 alone) has
    no token left in the loss and is still a backward pass, the accumulation boundary."""
    from transformers import AutoModelForCausalLM

    cut = with_truncated(groups, cut=((0, 1), (1, 0), (1, 3), (3, 2), (3, 3)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    truncated = torch.tensor([s.finish_reason == "length" for g in cut for s in g.samples])
    mask = batch.response_mask * (~truncated).float()[:, None]
    lp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
    loss, _ = decoupled_ppo_loss(lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, mask)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()

    trainer = PolicyTrainer(model_dir, config(stage), AlgorithmConfig(truncation={"mode": "mask"}))
    stats = trainer.train_step(cut)
    assert stats.truncated_frac == 5 / 16 and stats.sequences == 11
    assert stats.tokens == int(mask.sum())
    assert stats.loss == pytest.approx(loss.item(), rel=1e-5)
    after = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0)


def test_truncation_penalise_adds_dapos_overlong_penalty_to_the_reward(model_dir, groups):
    """penalise (L_max 7, L_cache 3: answers of 5, 6, 7 tokens lose 1/3, 2/3, 1): one step equals
    a step on the same groups whose rewards already hold the penalty."""
    algo = AlgorithmConfig(truncation={"mode": "penalise", "max_tokens": 7, "cache_tokens": 3})
    shifted = copy.deepcopy(groups)
    penalties = []
    for g in shifted:
        p = overlong_penalty([len(s.response_ids) for s in g.samples], 7, 3)
        penalties.extend(p)
        for s, pen in zip(g.samples, p):
            s.reward = float(np.float32(s.reward) + pen)
    assert min(penalties) == pytest.approx(-1.0) and max(penalties) == 0.0  # the test batch spans the interval

    penalised = PolicyTrainer(model_dir, config(0), algo)
    reference = PolicyTrainer(model_dir, config(0))
    for row, expected in zip(penalised.advantages(groups), reference.advantages(shifted)):
        np.testing.assert_allclose(row, expected, rtol=1e-6)
    stats = penalised.train_step(groups)
    assert stats.overlong_penalty == pytest.approx(float(np.mean(penalties)), rel=1e-6)
    assert stats.reward == pytest.approx(np.mean([s.reward for g in groups for s in g.samples]))
    reference.train_step(shifted)
    a, b = penalised.full_state_dict(), reference.full_state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match=r"truncation.mode \(penalise\) needs algorithm.truncation.max_tokens"):
        PolicyTrainer(model_dir, config(0), AlgorithmConfig(truncation={"mode": "penalise"}))


# --- several optimizer updates per batch (learner.ppo_epochs, learner.mini_batches) -----------


@pytest.mark.parametrize("micro_batch_tokens", [None, 24])
def test_epochs_and_mini_batches_clip_against_the_policy_before_the_first_update(micro_batch_tokens, model_dir, groups):
    """2 epochs x 2 mini-batches of 2 whole groups at ZeRO-2, micro batches of 5 rows (or packed
    to 24 token slots): four updates, each the token-mean loss of its mini-batch with the ratio
    and clip taken against pi_prox from before the first update, land on plain torch's weights;
    one version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    with torch.no_grad():
        proximal = token_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
    norms = []
    for _ in range(2):
        for rows in (slice(0, 8), slice(8, 16)):  # groups 0-1, groups 2-3
            ids, att = batch.input_ids[rows], batch.attention_mask[rows]
            lp = token_logprobs(model(input_ids=ids, attention_mask=att).logits, ids)
            loss, _ = decoupled_ppo_loss(
                lp, proximal[rows], batch.behaviour_logprobs[rows], batch.advantages[rows], batch.response_mask[rows]
            )
            optimizer.zero_grad()
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
            optimizer.step()

    trainer = PolicyTrainer(model_dir, config(2, micro_batch_tokens=micro_batch_tokens), ppo_epochs=2, mini_batches=2)
    stats = trainer.train_step(groups)
    assert trainer.version == 1 and stats.version == 1 and trainer.updates == stats.updates == 4
    assert stats.staleness == [0] * 16
    assert stats.grad_norm_by_update == pytest.approx(norms, rel=1e-4)
    assert stats.grad_norm == pytest.approx(np.mean(norms), rel=1e-4)
    assert len(stats.loss_by_update) == 4
    # the policy moves away from pi_prox over the updates; pi_prox / mu is the same throughout
    assert len(stats.approx_kl_by_epoch) == 2 and 0 < stats.approx_kl_by_epoch[0] < stats.approx_kl_by_epoch[1]
    assert len(stats.clipfrac_by_epoch) == 2 and stats.clipfrac >= 0
    assert stats.clipfrac == pytest.approx(stats.clipfrac_high + stats.clipfrac_low)
    assert stats.clipfrac_dual == 0.0 and stats.ppo_kl != 0.0  # no dual clip set; the policy moved
    assert 0.5 < stats.is_weight_mean < 2.0
    after = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-4, rtol=0)


def test_one_epoch_one_mini_batch_is_exactly_the_first_of_several_updates(model_dir, groups):
    """The single-update form (pi_prox = the update's own logprobs, detached) and the first
    update of a two-epoch step (pi_prox from the no-grad forward before it) give the identical
    loss, gradient norm and weights. The second epoch runs at learning rate 0 (a linear decay
    over one update), so its weights are the first update's."""
    single = PolicyTrainer(model_dir, config(0))
    one = single.train_step(groups)
    assert one.loss_by_update is None and one.clipfrac_by_epoch is None and one.approx_kl == 0.0
    assert one.ppo_kl == one.clipfrac_high == one.clipfrac_low == one.clipfrac_dual == 0.0
    decayed = config(0, lr_schedule="linear", lr_decay_steps=1)
    several = PolicyTrainer(model_dir, decayed, ppo_epochs=2)
    two = several.train_step(groups)
    assert two.lr == 0.0 and several.updates == 2
    assert two.loss_by_update[0] == one.loss
    assert two.grad_norm_by_update[0] == one.grad_norm
    a, b = single.full_state_dict(), several.full_state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_mini_batches_never_split_a_group_and_the_learner_config_checks_them():
    from asyncrl.learner.config import LearnerConfig

    with pytest.raises(ValueError, match=r"mini_batches \(5\) must be <= learner.batch_groups \(4\)"):
        LearnerConfig(batch_groups=4, mini_batches=5)
    with pytest.raises(ValueError, match="ppo_epochs"):
        LearnerConfig(ppo_epochs=0)
    assert LearnerConfig(batch_groups=4, ppo_epochs=3, mini_batches=2).updates_per_step == 6
    # ragged groups (3, 4, 2, 5 samples) in 3 mini-batches: runs of whole groups
    trainer = PolicyTrainer.__new__(PolicyTrainer)
    trainer.mini_batches = 3
    sized = [Group(f"g{i}", "p", "t", "", "", np.array([1]), 0, "gen", [None] * n) for i, n in enumerate((3, 4, 2, 5))]
    assert trainer._mini_batches(sized) == [(0, 7), (7, 9), (9, 14)]
    trainer.mini_batches = 8  # more than there are groups: one group each
    assert trainer._mini_batches(sized) == [(0, 3), (3, 7), (7, 9), (9, 14)]


def test_staleness_figures_count_each_segment_at_its_own_version(model_dir, hf_state):
    """Samples spanning an update (versions 0, then 3 from their third token) trained at version 3:
    the sequence is 3 stale (its oldest token), its tokens 3 and 0, and the sampler/learner
    mismatch is measured over the tokens sampled by version 3 alone."""
    model = hf_state[0]
    spanning = make_groups(model.config.vocab_size, policy_version=0, seed=5)
    for g in spanning:
        for s in g.samples:
            s.version_segments = [[0, 0], [2, 3]]
    trainer = PolicyTrainer(model_dir, config(0))
    trainer.version = 3
    stats = trainer.train_step(spanning)
    samples = [s for g in spanning for s in g.samples]
    tokens = sum(len(s.response_ids) for s in samples)
    assert stats.staleness == [3] * len(samples)
    assert stats.token_staleness == {0: tokens - 2 * len(samples), 3: 2 * len(samples)}
    batch = collate(spanning, [np.zeros(len(g.samples)) for g in spanning], pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    raw = (token_logprobs(logits, batch.input_ids) - batch.behaviour_logprobs).exp()  # pi_prox / mu
    fresh = batch.response_mask * (batch.behaviour_version == 3)
    k3 = (raw - 1) - raw.log()
    assert stats.mismatch_kl == pytest.approx(float((k3 * fresh).sum() / fresh.sum()), rel=1e-4)


def test_masking_removes_exactly_the_stale_tokens_from_the_loss(model_dir, hf_state):
    """Tokens before ``trained_from`` change nothing when their behaviour logprobs do (they are out
    of the loss); a token after it does. A sample with none trained is no sequence of the loss."""
    vocab = hf_state[0].config.vocab_size

    def step(garbage_at=None):
        groups = make_groups(vocab, seed=7)
        for g in groups:
            for s in g.samples:
                s.trained_from = 2
                if garbage_at is not None:
                    s.logprobs[garbage_at] -= 3.0  # a behaviour logprob far off pi_prox: a large weight
        groups[0].samples[0].trained_from = len(groups[0].samples[0].response_ids)
        trainer = PolicyTrainer(model_dir, config(0), AlgorithmConfig(correction="decoupled"))
        return trainer.train_step(groups), trainer.full_state_dict(), groups

    stats, weights, groups = step()
    samples = [s for g in groups for s in g.samples]
    masked = sum(s.trained_from for s in samples)
    assert stats.tokens == sum(len(s.response_ids) for s in samples) - masked
    assert stats.stale_tokens_masked == masked and stats.stale_samples_masked == 1
    assert stats.sequences == len(samples) - 1 and len(stats.staleness) == len(samples) - 1
    _, same, _ = step(garbage_at=1)  # inside every masked prefix
    for key in weights:
        torch.testing.assert_close(same[key], weights[key], rtol=0, atol=0)
    _, other, _ = step(garbage_at=2)  # the first trained token
    assert any(not torch.equal(other[key], weights[key]) for key in weights)
