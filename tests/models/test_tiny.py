"""The tiny Qwen2 model builds offline, reloads with the Auto classes, and is deterministic."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.models.tiny import TinyModelConfig, build_tiny_model, qwen2_config


def test_builds_a_reloadable_checkpoint(tmp_path):
    out = build_tiny_model(TinyModelConfig(), tmp_path / "tiny")
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer) == 259
    assert not model.config.tie_word_embeddings
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    assert 800_000 <= n_params <= 1_100_000, n_params
    logits = model(input_ids=torch.tensor([tokenizer("07+45=")["input_ids"]])).logits
    assert logits.shape == (1, 6, 259)


def test_padded_vocabulary_and_tied_embeddings(tmp_path):
    cfg = TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=1000, tie_word_embeddings=True
    )
    out = build_tiny_model(cfg, tmp_path / "padded")
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) == 1000 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.shape == (1000, 32)
    # one matrix for both ends: the untied model has another 1000 x 32 parameters
    untied = build_tiny_model(cfg.model_copy(update={"tie_word_embeddings": False}), tmp_path / "untied")
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(untied).parameters()) == n_params + 1000 * 32
    logits = model(input_ids=torch.tensor([tokenizer("07+45=")["input_ids"]])).logits
    assert logits.shape == (1, 6, 1000)


def test_qwen2_5_0_5b_shape_has_its_parameter_count():
    """The rehearsal recipe's shape is Qwen2.5-0.5B's 494 M parameters (built on the meta device: no memory)."""
    from transformers import Qwen2ForCausalLM

    from asyncrl.config import load_config

    tiny = load_config("configs/rehearsal_0_5b.yaml").model.tiny
    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen2_config(tiny))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


def test_same_seed_same_weights(tmp_path):
    a = load_file(build_tiny_model(TinyModelConfig(seed=3), tmp_path / "a") / "model.safetensors")
    b = load_file(build_tiny_model(TinyModelConfig(seed=3), tmp_path / "b") / "model.safetensors")
    c = load_file(build_tiny_model(TinyModelConfig(seed=4), tmp_path / "c") / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(TinyModelConfig(), tmp_path)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_size": 130}, r"hidden_size \(130\) must be divisible by num_heads \(4\)"),
        ({"num_kv_heads": 3}, r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
        ({"num_layers": 0}, r"num_layers \(0\) must be >= 1"),
        ({"vocab_size": 100}, r"vocab_size \(100\) must be None or >= 259"),
    ],
)
def test_config_rejects_bad_shapes(fields, message):
    with pytest.raises(ValueError, match=message):
        TinyModelConfig(**fields)
