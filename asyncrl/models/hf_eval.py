"""Held-out exact-match accuracy with greedy decoding in plain Hugging Face transformers.

The number a run reports before and after RL, so it must not depend on sampling: greedy
decoding, float32, fixed batch order. A hand-written greedy loop with a KV cache (rather
than ``generate``) keeps left padding and position ids explicit and costs little on the
tiny model: 500 addition prompts take well under a second of decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.tasks.answers import score_answer
from asyncrl.tasks.prompts import Prompt


def left_padded(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each [batch, max_len], padded on the left.

    Left padding puts every prompt's last token in the last column, so the next token of
    every row is read from the same position.
    """
    max_len = max(len(ids) for ids in token_lists)
    input_ids = torch.full((len(token_lists), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(token_lists), max_len), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        if ids:
            input_ids[row, max_len - len(ids) :] = torch.tensor(ids)
            attention_mask[row, max_len - len(ids) :] = 1
    return input_ids, attention_mask


@torch.no_grad()
def decode_with_cache(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode every prompt token by token with a KV cache, left-padded in one batch.

    ``pick`` maps the last position's logits (B, V) to the next token ids (B,): argmax for greedy
    decoding, a draw for sampling (it may record what it needs, e.g. the token's logprob). A row
    that has produced ``eos_id`` is fed ``pad_id`` from then on; decoding stops once every row
    has. Returns (tokens, alive), each (B, T): alive is False after a row's eos (the eos itself
    is alive)."""
    input_ids, attention_mask = left_padded(prompt_ids, pad_id)  # (B, P)
    # Positions count real tokens only, so a left-padded row sees the same positions as unpadded.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool)  # (B,)
    tokens: list[torch.Tensor] = []
    alive: list[torch.Tensor] = []
    past = None
    for _ in range(max_new_tokens):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        next_ids = pick(out.logits[:, -1, :])  # (B,)
        next_ids = torch.where(finished, torch.full_like(next_ids, pad_id), next_ids)
        alive.append(~finished)
        tokens.append(next_ids)
        finished = finished | (next_ids == eos_id)
        if finished.all():
            break
        input_ids = next_ids[:, None]  # (B, 1)
        position_ids = position_ids[:, -1:] + 1  # (B, 1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
    if not tokens:
        empty = torch.zeros((len(prompt_ids), 0), dtype=torch.long)
        return empty, empty.bool()
    return torch.stack(tokens, dim=1), torch.stack(alive, dim=1)


def greedy_generate(
    model: PreTrainedModel, prompt_ids: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int
) -> list[list[int]]:
    """Greedy continuations (without the eos) of each prompt, at most max_new_tokens each."""
    tokens, _ = decode_with_cache(model, prompt_ids, max_new_tokens, eos_id, pad_id, lambda logits: logits.argmax(-1))
    return [row[: row.index(eos_id)] if eos_id in row else row for row in tokens.tolist()]


def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    max_new_tokens: int,
    batch_size: int,
) -> list[str]:
    """Greedy response text for each prompt, in order."""
    responses: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        prompt_ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in chunk]
        for ids in greedy_generate(model, prompt_ids, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id):
            responses.append(tokenizer.decode(ids, skip_special_tokens=True))
    return responses


def evaluate_exact_match(
    model_dir_or_model: str | Path | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompts: list[Prompt],
    max_new_tokens: int = 4,
    batch_size: int = 250,
) -> float:
    """Fraction of prompts whose greedy response ``score_answer`` marks correct.

    ``tokenizer`` may be None when a model folder is given: it is loaded from there.
    The model is put in eval mode (and left there).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be >= 1")
    if not prompts:
        raise ValueError("prompts (0 given) must hold at least one prompt")
    if isinstance(model_dir_or_model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model_dir_or_model)
    else:
        model = model_dir_or_model
    if tokenizer is None:
        raise ValueError("tokenizer (None) must be given when a model object, not a folder, is passed")
    model.eval()
    responses = generate_responses(model, tokenizer, prompts, max_new_tokens, batch_size)
    scores = [score_answer(p.task, r, p.answer) for p, r in zip(prompts, responses)]
    return sum(scores) / len(scores)
