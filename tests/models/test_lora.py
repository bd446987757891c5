"""LoRA adapters (``asyncrl.models.lora``): the config's rules, the wrap, the names on the wire,
the peft folder and the merged model, on the tiny model without DeepSpeed."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import peft  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.models.lora import (  # noqa: E402
    DEFAULT_TARGET_MODULES,
    LoraConfig,
    adapter_meta,
    adapter_parameters,
    apply_lora,
    merged_model,
    save_adapter,
    trainable_parameters,
)
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), out)


SMALL = LoraConfig(rank=4, alpha=8)


def trained_adapter(model_dir, cfg=SMALL):
    """A wrapped tiny model whose adapter is non-zero (B starts at zero: a random one here)."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rank", 0, "rank (0) must be >= 1"),
        ("alpha", 0, "alpha (0) must be >= 1"),
        ("dropout", 1.0, "dropout (1.0) must be in [0, 1)"),
        ("target_modules", [], "must be a non-empty list"),
        ("target_modules", ["model.q_proj"], "without dots"),
    ],
)
def test_a_bad_value_is_named_with_its_rule(key, value, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        LoraConfig(**{key: value})


def test_model_lora_is_off_by_default_and_any_key_enables_it():
    assert load_config(None).model.lora is None
    cfg = load_config(None, ["model.lora.rank=8"]).model.lora
    assert cfg == LoraConfig(rank=8) and cfg.target_modules == list(DEFAULT_TARGET_MODULES)
    with pytest.raises(ValidationError, match="extra"):
        load_config(None, ["model.lora.rnk=8"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_takes_lora(stage):
    cfg = load_config(None, ["model.lora.rank=4", f"learner.trainer.zero_stage={stage}"])
    assert cfg.model.lora.rank == 4 and cfg.learner.trainer.zero_stage == stage


def test_wrap_freezes_the_base_and_starts_at_it(model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(rank=4))
    trainable = trainable_parameters(model)
    names = [name for name, _ in adapter_parameters(model)]
    assert len(trainable) == len(names) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    assert all("lora_A" in n or "lora_B" in n for n in names)
    assert sum(p.numel() for p in trainable) < 0.2 * sum(p.numel() for p in model.parameters())
    ids = torch.tensor([[5, 9, 13, 21, 8]])
    torch.testing.assert_close(logprobs(model.eval(), ids), logprobs(base, ids), atol=0, rtol=0)  # B = 0


def test_wire_names_are_peft_state_dict_names(model_dir):
    model = trained_adapter(model_dir)
    state = peft.get_peft_model_state_dict(model)
    ours = dict(adapter_parameters(model))
    assert list(ours) == list(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name].detach(), tensor)


def test_a_target_that_matches_no_layer_is_named(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"\['qkv'\] match no layer.*q_proj"):
        apply_lora(model, LoraConfig(target_modules=["q_proj", "qkv"]))


def test_meta_says_how_to_load():
    meta = adapter_meta(LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    assert meta == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "base_version": 0}


def test_saved_adapter_loads_with_peft_and_merges(model_dir, tmp_path):
    cfg = LoraConfig(rank=4, alpha=8)
    model = trained_adapter(model_dir, cfg)
    tensors = {name: p.detach() for name, p in adapter_parameters(model)}
    out = save_adapter(tensors, cfg, model_dir, tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(out)).eval()
    assert loaded.peft_config["default"].r == 4 and loaded.peft_config["default"].lora_alpha == 8
    ids = torch.tensor([[5, 9, 13, 21, 8, 40, 3]])
    expected = logprobs(model, ids)
    base = logprobs(AutoModelForCausalLM.from_pretrained(model_dir), ids)
    assert (expected - base).abs().max() > 1e-2  # the adapter moves the model
    torch.testing.assert_close(logprobs(loaded, ids), expected, atol=0, rtol=0)
    torch.testing.assert_close(logprobs(merged_model(model_dir, out).eval(), ids), expected, atol=1e-5, rtol=0)
