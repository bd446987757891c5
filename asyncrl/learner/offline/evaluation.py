"""Held-out figures of an offline run: the objective's loss and figures, and greedy exact match.

The loss is the objective's over the held-out examples (no gradient, the training layout): for
SFT the assistant tokens' mean NLL, for DPO the preference loss with its reward accuracy and
margin. Exact match decodes a greedy answer from each of the first ``eval.num_prompts``
examples' prompts (``asyncrl.models.hf_eval.greedy_generate``: float32 or the trainer's dtype,
KV cache, left padding) and scores it with the task's rule (``asyncrl.tasks.answers.score_answer``)
against the example's reference answer. Every rank decodes the same prompts: under ZeRO-3 each
forward gathers the partitioned weights, a collective every rank must join.
"""

from __future__ import annotations

import torch

from asyncrl.learner.offline.data import Example
from asyncrl.models.hf_eval import greedy_generate
from asyncrl.tasks.answers import score_answer


@torch.no_grad()
def exact_match(model, tokenizer, examples: list[Example], task: str, max_new_tokens: int, batch_size: int) -> dict:
    """{"exact_match", "answers": [first few (prompt, answer, reference)]}."""
    was_training = model.training
    model.eval()
    right, shown = 0, []
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            outputs = greedy_generate(
                model, [e.prompt_ids for e in chunk], max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id
            )
            for example, ids in zip(chunk, outputs):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                right += score_answer(task, text, example.answer) >= 1.0
                if len(shown) < 3:
                    shown.append({"answer": text[-200:], "reference": example.answer})
    finally:
        model.train(was_training)
    return {"exact_match": right / max(1, len(examples)), "answers": shown}
