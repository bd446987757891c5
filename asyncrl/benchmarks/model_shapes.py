"""Transformer shapes by name, for the learner's memory model (``asyncrl.benchmarks.memory_model``).

A shape is what the memory arithmetic needs of a decoder-only model of the Llama/Qwen2 family:
width, depth, heads, key/value heads (grouped-query attention), the SwiGLU MLP's width, the
vocabulary, tied embeddings and whether q/k/v carry biases (Qwen2 does, Llama does not). The named
shapes are copied from each model's ``config.json`` on the Hugging Face Hub (the address is kept
in ``source``); any other model is read from its own config (``shape_from_hf_config``).

The parameter count follows the modules one by one (embedding, per block q/k/v/o, gate/up/down
and two RMSNorms, the final norm, an untied LM head); for the named shapes it gives the published
totals (Qwen2.5-7B 7.62 B, Qwen2.5-32B 32.76 B, Llama-3-8B 8.03 B), which
``tests/benchmarks/test_memory_model.py`` checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama/Qwen2-style decoder (SwiGLU MLP, RMSNorm, rotary positions)."""

    name: str
    hidden: int
    """h: width of the residual stream."""
    layers: int
    """L: transformer blocks."""
    heads: int
    """a: query heads (head dimension d = h / a)."""
    kv_heads: int
    """Key/value heads (grouped-query attention), dividing ``heads``."""
    intermediate: int
    """f: the MLP's hidden width (gate, up: h -> f; down: f -> h)."""
    vocab: int
    """V: rows of the embedding (and of the LM head)."""
    tied: bool
    """One matrix for the embedding and the LM head."""
    qkv_bias: bool
    """q/k/v projections carry biases (Qwen2: yes; Llama: no)."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} ({getattr(self, key)}) must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of k (and of v): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    def block_parameters(self) -> int:
        """One transformer block: q, k, v, o, gate, up, down and two RMSNorm weights."""
        h, kv, f = self.hidden, self.kv_width, self.intermediate
        attention = h * h + 2 * h * kv + h * h + ((h + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * f + 2 * h

    def embedding_parameters(self) -> int:
        """The input embedding, and the LM head when untied."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def parameters(self) -> int:
        """Every parameter: embeddings, the blocks, the final norm."""
        return self.embedding_parameters() + self.layers * self.block_parameters() + self.hidden

    def small_parameters(self, threshold: int) -> int:
        """Parameters of the tensors with at most ``threshold`` elements (norm weights, biases):
        the ones ZeRO-3 keeps whole on every rank (``stage3_param_persistence_threshold``)."""
        h, kv = self.hidden, self.kv_width
        sizes = [h, h] + ([h, kv, kv] if self.qkv_bias else [])  # per block
        return self.layers * sum(s for s in sizes if s <= threshold) + (h if h <= threshold else 0)

    def with_vocab(self, vocab: int) -> ModelShape:
        """The same blocks with another vocabulary (the character tokenizer's 259, a padded one)."""
        return replace(self, name=f"{self.name}@vocab{vocab}", vocab=vocab)


def _qwen(name, h, layers, heads, kv, f, vocab, tied, repo) -> ModelShape:
    return ModelShape(
        name, h, layers, heads, kv, f, vocab, tied, True, f"https://huggingface.co/{repo}/blob/main/config.json"
    )


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(
            "smollm2-135m",
            576,
            30,
            9,
            3,
            1536,
            49152,
            True,
            False,
            "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json "
            "(134,515,008 parameters as loaded here, SETUP-NOTES)",
        ),
        _qwen("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True, "Qwen/Qwen2.5-0.5B"),
        _qwen("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, True, "Qwen/Qwen2.5-1.5B"),
        _qwen("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True, "Qwen/Qwen2.5-3B"),
        _qwen("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False, "Qwen/Qwen2.5-7B"),
        _qwen("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, False, "Qwen/Qwen2.5-14B"),
        _qwen("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, False, "Qwen/Qwen2.5-32B"),
        ModelShape(
            "llama-3-8b",
            4096,
            32,
            32,
            8,
            14336,
            128256,
            False,
            False,
            "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
        ),
        # The benchmarks' own Qwen2 shapes (asyncrl.models.tiny), character vocabulary.
        ModelShape(
            "bench-0.1b", 768, 12, 12, 2, 3072, 259, False, True, "this project: a 0.1 B Qwen2 for the memory check"
        ),
        ModelShape("tiny", 64, 2, 4, 2, 256, 259, False, True, "this project: the memory model's test"),
    )
}


def shape_from_hf_config(config: dict | str | Path, name: str | None = None) -> ModelShape:
    """The shape in a Hugging Face ``config.json`` (a dict, the file, or the model's folder)."""
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        name = name or path.parent.name
        config = json.loads(path.read_text())
    heads = config["num_attention_heads"]
    model_type = config.get("model_type", "")
    return ModelShape(
        name or config.get("_name_or_path") or model_type or "model",
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        source="config.json",
    )


def shape(spec: str) -> ModelShape:
    """A named shape, ``NAME@vocabN`` for another vocabulary, or a path to a config.json / model folder."""
    name, _, vocab = spec.partition("@vocab")
    if name in SHAPES:
        found = SHAPES[name]
        return found.with_vocab(int(vocab)) if vocab else found
    if Path(name).exists():
        found = shape_from_hf_config(name)
        return found.with_vocab(int(vocab)) if vocab else found
    raise ValueError(f"shape ({spec!r}) must be one of {sorted(SHAPES)} (optionally @vocabN) or a config.json path")
