"""PolicyTrainer on a tiny model: every ZeRO stage, one optimizer step per call, weights out.

All engines share one gloo process group in this process (DeepSpeed allows re-initialising
engines on it). Each stage trains with micro batches of 5 sequences (16 per batch: 5+5+5+1)
and must land on the same weights as a plain-torch AdamW step on the whole batch at once; so do
the learning-rate schedule, small logit chunks with gradient checkpointing and small ZeRO buckets.
bf16 trains close to fp32, and a checkpoint round trip, ``load_state`` and ``asyncrl export``
keep the trainer's weights exactly. In fp32 the optimizer's master partition is the model's own
storage at ZeRO 1-3 (``asyncrl.learner.fp32_master``), through training and a resume.
"""

import math

import numpy as np
import pytest
import torch

from asyncrl.learner.advantages import grpo_advantages
from asyncrl.learner.batch import collate, token_logprobs
from asyncrl.learner.fp32_master import fp32_master_shares_storage
from asyncrl.learner.losses import decoupled_ppo_loss
from asyncrl.learner.trainer import PolicyTrainer, TrainerConfig
from tests.learner.trainer.steps import GRAD_CLIP, LR, config, make_groups

pytestmark = pytest.mark.slow  # DeepSpeed engines at every ZeRO stage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_steps_at_each_zero_stage(stage, model_dir, hf_state, groups, reference_weights):
    trainer = PolicyTrainer(model_dir, config(stage))
    assert trainer.version == 0
    # fp32 weights are held once: the optimizer's master partition is the model's own storage
    assert fp32_master_shares_storage(trainer.engine.optimizer) is (None if stage == 0 else True)
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
    assert fp32_master_shares_storage(trainer.engine.optimizer) is (None if stage == 0 else True)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_fp32_master_partition_is_the_models_own_storage(stage, model_dir):
    """ZeRO-1/2: each group's master partition is a view of the model's flat buffer, so the
    weights are held once; ZeRO-3: the same, for its flat partition. bf16 keeps its fp32 master."""
    from asyncrl.learner.fp32_master import master_pairs

    trainer = PolicyTrainer(model_dir, config(stage))
    pairs = master_pairs(trainer.engine.optimizer)
    assert pairs
    for master, own in pairs:
        assert master.data_ptr() == own.data_ptr() and master.numel() == own.numel()
        assert master.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
    saved = trainer.engine.optimizer.state_dict()  # a checkpoint's: the partitions alone, not the buffer they view
    masters = saved.get("single_partition_of_fp32_groups") or saved["fp32_flat_groups"]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in masters)
    if stage < 3:  # and the model's parameters are views of that flat buffer
        flat = trainer.engine.optimizer.bit16_groups_flat[0]
        start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        assert all(start <= p.data_ptr() < end for p in trainer.engine.module.parameters())
    bf16 = PolicyTrainer(model_dir, config(stage, dtype="bf16"))
    assert fp32_master_shares_storage(bf16.engine.optimizer) is False
    assert all(master.dtype == torch.float32 for master, _ in master_pairs(bf16.engine.optimizer))


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


def test_bf16_if_native_trains_in_what_this_cpu_multiplies_natively(model_dir, groups):
    from asyncrl.models.precision import native_bf16

    trainer = PolicyTrainer(model_dir, config(2, dtype="bf16_if_native"))
    want = torch.bfloat16 if native_bf16(cuda=False) else torch.float32
    assert trainer.cfg.dtype == ("bf16" if want == torch.bfloat16 else "fp32")
    assert next(trainer.engine.module.parameters()).dtype == want
    assert math.isfinite(trainer.train_step(groups).loss)


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
    assert fp32_master_shares_storage(resumed.engine.optimizer) is True  # a resume keeps the weights once


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
