"""Supervised fine-tuning (SFT): the warm start before RL.

GRPO-style RL only learns when some sampled responses earn a reward, so a model that never
answers correctly gives no signal. A short SFT run teaches the answer format (digits then
``<eos>``) and leaves partial accuracy for RL to improve. Plain torch AdamW on the CPU:
the tiny model needs no DeepSpeed. ``sft_batch`` (tensors) is kept apart from ``run_sft``
(the loop) so a full SFT feature can reuse it.

A single-turn run learns prompt + reference answer. A multi-turn run learns whole episodes
(``TokenExample``: the prompt, the model's turns and the environment's answers, as token ids with
a loss mask): ``run_sft`` takes a function that turns a batch's prompts into such examples (the
controller's ``asyncrl.controller.demonstrations``, from the environment's demonstrations), and
only the model's tokens are learned, as only they are trained in RL.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import field_validator, model_validator

from asyncrl.configbase import Config
from asyncrl.tasks.prompts import Prompt

if TYPE_CHECKING:  # torch and transformers load lazily: reading a config must stay cheap
    import torch
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # label value that torch's cross-entropy (and HF's loss) skips


class SFTConfig(Config):
    """Supervised warm start.

    The defaults stop the tiny addition model (seed 0) mid-way through its jump from ~5% to
    ~80% held-out exact match: 51% after 400 steps with today's libraries (28% when first
    calibrated), 15-20 s on one core; where the jump comes depends on the seed of the initial
    weights (``configs/demo.yaml`` takes 500 steps for the demo's sake). The rate stays constant after warmup on purpose: from a checkpoint left at the full
    rate, on-policy GRPO (lr 1e-4, 32 prompts x 8) went 0.28 -> 0.70 in 150 steps; from a
    cosine-decayed one (0.24), the same GRPO only reached 0.39, and larger rates were noisy.
    """

    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 32
    """Prompts per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (3e-3 left the tiny addition model under 15% after 300-500 steps)."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to lr; a cosine decay to min_lr_ratio * lr follows."""
    min_lr_ratio: float = 1.0
    """Learning rate at the last step, as a fraction of lr (1.0: constant after warmup)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the gradient to this global norm (0 disables clipping)."""
    seed: int = 0
    """Seed of the batch order (the prompts are shuffled every epoch)."""
    log_every: int = 0
    """Print the loss every this many steps (0 prints nothing)."""

    @field_validator("steps", "batch_size")
    @classmethod
    def check_positive(cls, value: int, info) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name} ({value}) must be >= 1")
        return value

    @field_validator("lr")
    @classmethod
    def check_lr(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"lr ({value}) must be > 0")
        return value

    @field_validator("warmup_steps", "log_every")
    @classmethod
    def check_non_negative(cls, value: int, info) -> int:
        if value < 0:
            raise ValueError(f"{info.field_name} ({value}) must be >= 0")
        return value

    @field_validator("min_lr_ratio")
    @classmethod
    def check_min_lr_ratio(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"min_lr_ratio ({value}) must be in [0, 1]")
        return value

    @field_validator("weight_decay", "max_grad_norm")
    @classmethod
    def check_not_negative(cls, value: float, info) -> float:
        if value < 0:
            raise ValueError(f"{info.field_name} ({value}) must be >= 0")
        return value

    @model_validator(mode="after")
    def check_warmup(self) -> SFTConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be <= steps ({self.steps})")
        return self


@dataclass(frozen=True)
class TokenExample:
    """One SFT sequence: ``ids`` (the prompt first) and ``mask``, 1 on each token to learn."""

    ids: list[int]
    mask: list[int]

    def __post_init__(self):
        if len(self.ids) != len(self.mask):
            raise ValueError(f"mask ({len(self.mask)} tokens) must be as long as ids ({len(self.ids)})")


def sft_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels), each [batch, max_len].

    Each row is prompt + answer + eos. Labels copy the ids on the answer and eos tokens and
    are IGNORE_INDEX on prompt and padding tokens, so only the answer is learned.
    Prompt and answer are tokenized apart, as a generator sees them (prompt ids, then
    sampled ids), so the boundary is the same as at RL time for any tokenizer.
    """
    if not prompts:
        raise ValueError("prompts (0 given) must hold at least one prompt")
    _check_special_tokens(tokenizer)
    examples = []
    for prompt in prompts:
        prompt_ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(prompt.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append(TokenExample(prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)))
    return token_batch(examples, tokenizer.pad_token_id)


def token_batch(examples: list[TokenExample], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels), each [batch, max_len]: labels copy the
    ids where the example's mask is 1 and are IGNORE_INDEX elsewhere (masked tokens, padding)."""
    import torch

    if not examples:
        raise ValueError("examples (0 given) must hold at least one example")
    max_len = max(len(e.ids) for e in examples)
    input_ids = torch.full((len(examples), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), max_len), dtype=torch.long)
    labels = torch.full((len(examples), max_len), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        ids, n = torch.tensor(example.ids, dtype=torch.long), len(example.ids)
        input_ids[row, :n] = ids
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.where(torch.tensor(example.mask, dtype=torch.bool), ids, IGNORE_INDEX)
    return input_ids, attention_mask, labels


def _check_special_tokens(tokenizer) -> None:
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(f"tokenizer ({type(tokenizer).__name__}) must define eos and pad tokens")


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Learning rate of 0-based ``step``: linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def iterate_batches(prompts: list[Prompt], batch_size: int, seed: int):
    """Endless batches: the prompts reshuffled (seeded) every epoch, epochs joined end to end."""
    rng = random.Random(seed)
    pending: list[Prompt] = []
    while True:
        while len(pending) < batch_size:
            epoch = list(prompts)
            rng.shuffle(epoch)
            pending.extend(epoch)
        yield pending[:batch_size]
        pending = pending[batch_size:]


def run_sft(
    model_dir: str | Path,
    prompts: list[Prompt],
    cfg: SFTConfig,
    out_dir: str | Path,
    examples: Callable[[list[Prompt]], list[TokenExample]] | None = None,
) -> dict:
    """Fine-tune the model in ``model_dir`` on ``prompts``; save model + tokenizer to ``out_dir``.

    ``examples``: what each batch of prompts is learned as (episodes, with their loss masks);
    None: each prompt's text + reference answer + eos (``sft_batch``).
    Returns {"steps", "final_loss" (mean of the last 10 steps), "seconds"}.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.char_tokenizer import save_tokenizer

    if not prompts:
        raise ValueError("prompts (0 given) must hold at least one prompt")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _check_special_tokens(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = iterate_batches(prompts, cfg.batch_size, cfg.seed)
    losses: list[float] = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = next(batches)
        if examples is None:
            input_ids, attention_mask, labels = sft_batch(tokenizer, batch)
        else:
            input_ids, attention_mask, labels = token_batch(examples(batch), tokenizer.pad_token_id)
        # HF shifts labels by one inside: position t predicts token t + 1.
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
        if cfg.log_every and (step + 1) % cfg.log_every == 0:
            print(f"sft step {step + 1}/{cfg.steps} loss {losses[-1]:.4f} lr {lr_at(step, cfg):.2e}", flush=True)
    model.eval()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    tail = losses[-10:]
    return {"steps": cfg.steps, "final_loss": sum(tail) / len(tail), "seconds": time.perf_counter() - started}
