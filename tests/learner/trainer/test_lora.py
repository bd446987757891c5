"""PolicyTrainer with LoRA adapters (``model.lora``) on a tiny model, at ZeRO stages 0-3.

Only the adapters train and the optimizer holds nothing else; a version goes out as the adapter's
tensors alone, named as peft names them, with the meta that says how to load them; the probe
scores the adapted policy; the KL reference is the base model; a checkpoint holds no base weight
and a resume from it takes the same next step as the run that never stopped; the final model
and ``asyncrl export`` (adapter, merged, of a checkpointed step) give the learner's logprobs.
All trainers share one gloo process group in this process, as in ``test_zero_stages``.
"""

import contextlib

import pytest
import torch

from asyncrl.learner.adapter import AdapterOffReference
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.trainer import PolicyTrainer
from asyncrl.models.lora import LoraConfig
from tests.learner.trainer.steps import config

pytestmark = pytest.mark.slow  # DeepSpeed engines

LORA = LoraConfig(rank=4, alpha=8)
IDS = torch.tensor([[5, 9, 13, 21, 8, 40, 3, 17]])


def lora_trainer(model_dir, stage, **kwargs):
    return PolicyTrainer(model_dir, config(stage), lora=LORA, **kwargs)


def adapter_state(trainer) -> dict[str, torch.Tensor]:
    """The trainer's published tensors, copied (gathered under ZeRO-3)."""
    return {name: t.clone() for bucket in trainer.weight_buckets(1 << 20) for name, t in bucket}


def logprobs(model, ids=IDS):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_the_adapter_trains_at_each_zero_stage(stage, model_dir, groups):
    import peft

    trainer = lora_trainer(model_dir, stage)
    held = [p for group in trainer.engine.optimizer.param_groups for p in group["params"]]
    n_adapter = len(list(trainer.weight_buckets(1 << 30))[0])
    assert n_adapter == 2 * 7 * 2  # lora_A and lora_B on 7 projections of 2 layers
    assert sum(p.numel() for p in held) == sum(p.numel() for p in trainer.engine.module.parameters() if p.requires_grad)
    before = trainer.full_state_dict()
    for _ in range(2):  # B starts at 0, so A's gradient is 0 until B has moved: two steps move both
        stats = trainer.train_step(groups)
        assert stats.grad_norm > 0
    after = trainer.full_state_dict()
    assert list(after) == list(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if "lora_" in k}, sorted(changed ^ {k for k in before if "lora_" in k})

    published = adapter_state(trainer)  # what a version carries: the adapter alone, peft's names
    gather = contextlib.nullcontext()
    if stage == 3:  # peft reads the parameters as they are: gathered, under ZeRO-3
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(trainer.engine.module.parameters()), modifier_rank=None)
    with gather:
        expected = {k: v.clone() for k, v in peft.get_peft_model_state_dict(trainer.engine.module).items()}
    assert list(published) == list(expected)
    for name, t in expected.items():
        assert torch.equal(published[name], t)
    assert all(t.dtype == torch.float32 for t in published.values())  # the model's dtype
    assert trainer.adapter_meta == {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": list(LORA.target_modules),
        "base_version": 0,
    }


def test_bf16_publishes_the_adapter_in_bf16(model_dir, groups):
    trainer = PolicyTrainer(model_dir, config(0, dtype="bf16"), lora=LORA)
    trainer.train_step(groups)
    assert {t.dtype for t in adapter_state(trainer).values()} == {torch.bfloat16}


def test_probe_scores_the_adapted_policy_and_the_reference_is_the_base(model_dir, groups):
    from transformers import AutoModelForCausalLM

    algo = AlgorithmConfig(kl={"coef": 0.1})
    trainer = lora_trainer(model_dir, 0, algo=algo)
    assert isinstance(trainer.reference, AdapterOffReference)  # no second copy of the model
    start = trainer.probe()
    trainer.train_step(groups)
    trainer.train_step(groups)
    probe = trainer.probe()
    assert probe["logprobs"] != start["logprobs"]  # the adapter is on
    assert probe == trainer.probe()  # no dropout: the same numbers each time

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mask = torch.ones(1, IDS.shape[1] - 1)
    ref = trainer.reference.logprobs(IDS, torch.ones_like(IDS), mask, trainer.distribution)
    expected = logprobs(base).gather(2, IDS[:, 1:, None])[..., 0]
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)
    assert trainer.engine.module.training  # the reference put the policy back in training mode
    adapted = logprobs(trainer.engine.module.eval()).gather(2, IDS[:, 1:, None])[..., 0]
    trainer.engine.module.train()
    assert (adapted - ref).abs().max() > 1e-4  # the reference is not the policy


def test_zero3_reference_is_the_partitioned_base_with_the_adapter_off(model_dir, groups):
    # Under ZeRO-3 too the reference is the engine's own base with the adapter off (no second
    # copy); its forward passes gather collectively, so the step gives every rank as many.
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(model_dir, 3, algo=AlgorithmConfig(kl={"coef": 0.1}))
    assert isinstance(trainer.reference, AdapterOffReference) and trainer.reference.collective
    trainer.train_step(groups)
    trainer.train_step(groups)
    mask = torch.ones(1, IDS.shape[1] - 1)
    ref = trainer.reference.logprobs(IDS, torch.ones_like(IDS), mask, trainer.distribution)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.testing.assert_close(ref, logprobs(base).gather(2, IDS[:, 1:, None])[..., 0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage, tied", [(0, False), (2, True), (3, True)])
def test_checkpoint_holds_the_adapter_only_and_resume_takes_the_same_step(
    stage, tied, model_dir, groups, tmp_path_factory
):
    tmp_path = tmp_path_factory.mktemp("ckpt")
    if tied:  # an output head tied to the embedding (SmolLM2's) is frozen and not saved either
        from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

        shape = TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, tie_word_embeddings=True)
        model_dir = build_tiny_model(shape, tmp_path / "tied")
    trainer = lora_trainer(model_dir, stage)
    trainer.train_step(groups)
    trainer.save_state(tmp_path / "ckpt")
    trainer.train_step(groups)
    expected = adapter_state(trainer)

    saved = {}
    for path in (tmp_path / "ckpt" / "policy").glob("*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved.update({k: v for k, v in (state.get("module") or {}).items()})
    assert saved == {} or all("lora_" in k for k in saved), [k for k in saved if "lora_" not in k]
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    ckpt_bytes = sum(p.stat().st_size for p in (tmp_path / "ckpt" / "policy").glob("*.pt"))
    assert ckpt_bytes < model_bytes / 2, (ckpt_bytes, model_bytes)  # the base (all but ~9 %) is not in it

    assert ckpt_bytes < 8 * sum(t.numel() * t.element_size() for t in expected.values())  # adapter, master, 2 moments
    resumed = lora_trainer(model_dir, stage)
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.version == 1
    resumed.train_step(groups)
    got = adapter_state(resumed)
    assert list(got) == list(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name  # bit for bit


def test_final_model_and_export_give_the_learners_logprobs(model_dir, groups, tmp_path):
    """``RUN_DIR/final`` (the merged model and its adapter), and ``asyncrl export`` of it and of a
    checkpointed step, adapter and merged: each gives the learner's logprobs."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.cli import main
    from asyncrl.config import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None, ["model.lora.rank=4", "model.lora.alpha=8"])))
    shutil.copytree(model_dir, run / "model" / "warm")
    trainer = lora_trainer(run / "model" / "warm", 2)
    trainer.train_step(groups)
    trainer.train_step(groups)
    trainer.save_state(run / "checkpoints" / "v00000002" / "learner")
    trainer.save_pretrained(run / "final")
    expected = logprobs(trainer.engine.module.eval())
    trainer.engine.module.train()

    def base():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    assert main(["export", str(run), str(tmp_path / "adapter")]) == 0
    assert main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    assert main(["export", str(run), str(tmp_path / "adapter2"), "--step", "2"]) == 0
    assert main(["export", str(run), str(tmp_path / "merged2"), "--step", "2", "--merge"]) == 0
    for name in ("adapter", "adapter2"):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        loaded = PeftModel.from_pretrained(base(), str(tmp_path / name)).eval()
        torch.testing.assert_close(logprobs(loaded), expected, atol=1e-6, rtol=0)
    for folder in (run / "final", tmp_path / "merged", tmp_path / "merged2"):
        merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert not any("lora" in k for k in merged.state_dict())
        torch.testing.assert_close(logprobs(merged), expected, atol=1e-5, rtol=0)
    assert (tmp_path / "merged" / "tokenizer_config.json").exists()
    assert (tmp_path / "merged" / "adapter").exists() is False


def test_a_published_version_is_what_the_generators_load(model_dir, groups, tmp_path):
    """The contract with the generator side (``asyncrl.generators.engines.lora``): the buckets and
    the meta of a version, read as a generator reads them, give the learner's adapted logprobs
    (as a peft adapter folder, and merged into the base as an engine without LoRA would)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.generators.engines.lora import AdapterSpec, merge_adapter, write_adapter

    trainer = lora_trainer(model_dir, 1)
    trainer.train_step(groups)
    trainer.train_step(groups)
    expected = logprobs(trainer.engine.module.eval())
    trainer.engine.module.train()
    spec = AdapterSpec.from_meta(trainer.adapter_meta)
    named = [(name, t.clone()) for bucket in trainer.weight_buckets(4096) for name, t in bucket]  # several buckets
    folder = write_adapter(named, spec, tmp_path / "v2")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.testing.assert_close(
        logprobs(PeftModel.from_pretrained(base, str(folder)).eval()), expected, atol=1e-6, rtol=0
    )
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    merged.load_state_dict(dict(merge_adapter(merged.state_dict(), named, spec)), strict=False)
    torch.testing.assert_close(logprobs(merged), expected, atol=1e-5, rtol=0)
