"""A reward model: a Hugging Face sequence-classification model scoring (prompt, answer) pairs.

The text ``template.format(prompt=..., response=...)`` of every sample of a group is tokenized,
right-padded and scored in batches of ``batch_size``; the reward is the logit of ``label_index``
(``AutoModelForSequenceClassification`` with one label is the usual reward-model head; Qwen2's
head reads the last non-pad token). Forward passes run in a thread, one at a time (a model is not
re-entrant and two on 2 cores would only contend), so the worker keeps serving other rewards.

``build_tiny_reward_model(out_dir)`` writes a tiny random ``Qwen2ForSequenceClassification`` with
the character tokenizer, for tests: its scores mean nothing, its plumbing is the real one.
"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.rewards.base import RewardResult, Unscored
from asyncrl.wire.schema import Group


class RewardModelConfig(Config):
    """Where the reward model is and how it is fed."""

    path: str
    """Hugging Face model directory with a sequence-classification head and its tokenizer."""
    template: str = "{prompt}{response}"
    """Text the model scores; ``{prompt}`` and ``{response}`` are filled in."""
    batch_size: int = Field(16, ge=1)
    """Samples per forward pass."""
    max_length: int = Field(512, ge=1)
    """Tokens kept per text (truncated from the right)."""
    label_index: int = Field(0, ge=0)
    """Which output logit is the reward."""
    device: str = "cpu"
    """Torch device of the model."""


class RewardModel:
    def __init__(self, name: str, cfg: RewardModelConfig):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = name
        self.cfg = cfg
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(cfg.path).to(cfg.device).eval()
        self._lock = threading.Lock()

    def score_texts(self, texts: list[str]) -> list[float]:
        out: list[float] = []
        with self._lock, self.torch.inference_mode():
            for start in range(0, len(texts), self.cfg.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.cfg.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.cfg.max_length,
                ).to(self.cfg.device)
                logits = self.model(**batch).logits  # (B, num_labels)
                out.extend(logits[:, self.cfg.label_index].float().tolist())
        return out

    async def score(self, group: Group) -> list[RewardResult]:
        texts = [self.cfg.template.format(prompt=group.prompt, response=s.text) for s in group.samples]
        values = await asyncio.to_thread(self.score_texts, texts)
        return [v if math.isfinite(v) else Unscored("nonfinite_score", repr(v)) for v in values]

    async def close(self) -> None:
        pass


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random ``Qwen2ForSequenceClassification`` (1 label) with the character tokenizer."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    from asyncrl.models.char_tokenizer import build_char_tokenizer
    from asyncrl.models.tiny import TinyModelConfig, qwen2_config

    out = Path(out_dir)
    tokenizer = build_char_tokenizer(out)
    shape = TinyModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=128
    )
    config = qwen2_config(
        shape,
        vocab_size=len(tokenizer),
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    model.save_pretrained(out, safe_serialization=True)
    return out
