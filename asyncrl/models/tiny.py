"""A tiny randomly initialised Qwen2 model with the character tokenizer, built offline.

Tests, CI and the CPU demo need a real Hugging Face checkpoint (loadable by transformers,
vLLM and DeepSpeed) without downloading one. Qwen2 is an architecture every one of those
supports; at the defaults it has 1.05 M parameters, so it trains in seconds on a CPU.

The same builder makes a model of a real model's size at random initialisation, for
rehearsing the pipeline at that size: the Qwen2.5-0.5B shape (``configs/rehearsal_0_5b.yaml``)
is 24 layers of width 896 with ``vocab_size: 151936`` and tied embeddings, 494 M parameters.
The character tokenizer is then padded with placeholder tokens to the model's vocabulary
(``asyncrl.models.char_tokenizer``), so every id the random model samples decodes.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from asyncrl.configbase import Config

CHAR_VOCAB_SIZE = 259  # len(asyncrl.models.char_tokenizer.char_vocabulary()), without importing transformers
SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings")


class TinyModelConfig(Config):
    """Shape and seed of the tiny Qwen2 model."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention (query) heads; must divide hidden_size."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 512
    """Width of the MLP's hidden layer."""
    max_position_embeddings: int = 64
    """Longest sequence (prompt + response) in tokens."""
    vocab_size: int | None = None
    """Rows of the embedding and output layers; None: the character tokenizer's 259. Larger pads
    the tokenizer with placeholder tokens to match (Qwen2.5's 151,936 gives its real size)."""
    tie_word_embeddings: bool = False
    """Share one matrix between the input embedding and the output layer (Qwen2.5-0.5B does)."""
    seed: int = 0
    """Seed of the random initialisation: the same seed builds the same weights."""

    @model_validator(mode="after")
    def check_shape(self) -> TinyModelConfig:
        for name in SIZE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.vocab_size is not None and self.vocab_size < CHAR_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) must be None or >= {CHAR_VOCAB_SIZE} (the character tokenizer)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        return self


def qwen2_config(cfg: TinyModelConfig, vocab_size: int | None = None, **extra):
    """The transformers ``Qwen2Config`` of ``cfg``'s shape, in float32. ``vocab_size`` overrides
    ``cfg.vocab_size`` (the builder passes its tokenizer's length); ``extra`` sets other fields
    (special token ids). Built on the meta device it counts a shape's parameters for free."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size if vocab_size is not None else (cfg.vocab_size or CHAR_VOCAB_SIZE),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        dtype="float32",
        **extra,
    )


def build_tiny_model(cfg: TinyModelConfig, out_dir: str | Path) -> Path:
    """Write tokenizer + randomly initialised float32 weights to ``out_dir`` and return it."""
    import torch  # lazily: reading a config must not load torch and transformers
    from transformers import Qwen2ForCausalLM

    from asyncrl.models.char_tokenizer import build_char_tokenizer

    out = Path(out_dir)
    tokenizer = build_char_tokenizer(out, cfg.vocab_size)
    config = qwen2_config(
        cfg,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    # A private generator state: building a model must not depend on, or disturb, global RNG use.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out
