"""Small builders of wire records and models for tests."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from asyncrl.wire.schema import Group, Sample

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML-like chat template for the character tokenizer: its end of turn is ``<eos>``."""


def chatml_char_tokenizer(folder: Path):
    """The demo's character tokenizer, built in ``folder``, with ``CHATML`` as its chat template."""
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(folder)
    tok.chat_template = CHATML
    return tok


def make_group(group_id: str = "g0", n: int = 4, version: int = 0, rewards=None, length: int = 3) -> Group:
    rewards = rewards if rewards is not None else [None] * n
    samples = [
        Sample(
            uid=f"{group_id}/{i}",
            response_ids=np.arange(length, dtype=np.int32) + i,
            logprobs=np.full(length, -0.5, dtype=np.float32),
            text=str(i),
            finish_reason="stop",
            reward=rewards[i],
        )
        for i in range(n)
    ]
    return Group(
        group_id=group_id,
        prompt_uid=f"addition/{group_id}",
        task="addition",
        prompt="01+02=",
        answer="3",
        prompt_ids=np.array([5, 6, 7], dtype=np.int32),
        policy_version=version,
        generator="test",
        samples=samples,
    )


def small_qwen2(vocab_size: int, tied: bool = False, attn: str | None = None):
    """A 2-layer, 32-wide Qwen2 at a fixed seed (torch's global RNG reseeded to 0): fast enough
    for exactness checks against plain torch, with grouped-query attention like the real ones."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        **({"attn_implementation": attn} if attn is not None else {}),
    )
    return Qwen2ForCausalLM(config)


class RecordingContext:
    """Stands in for a process context where the weight path reports: keeps each event it is
    sent in ``events``."""

    def __init__(self):
        self.events: list = []

    def emit(self, event):
        self.events.append(event)


def two_tiny_models(root: Path) -> dict[str, Path]:
    """The project's tiny model at seeds 1 and 2, as ``root/a`` and ``root/b``: two sets of weights
    of one shape, to swap an engine between."""
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    return {
        name: Path(build_tiny_model(TinyModelConfig(seed=seed), root / name)) for name, seed in (("a", 1), ("b", 2))
    }


@contextmanager
def vllm_engine(tmp_path_factory, model_dir, version: int = 0):
    """A vLLM engine on ``model_dir`` (max_model_len 64, block 32, seed 0), closed on exit.

    vLLM leaves files in TMPDIR: they go to pytest's tmp dir, and TMPDIR is given back however the
    engine's start ends (a later Ray test's socket paths must stay short)."""
    import pytest

    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("vllm_tmp")))
        tempfile.tempdir = None
        try:
            engine = VLLMEngine(str(model_dir), EngineConfig(max_model_len=64, block_size=32, seed=0), version=version)
            yield engine
            engine.close()
        finally:
            tempfile.tempdir = None
