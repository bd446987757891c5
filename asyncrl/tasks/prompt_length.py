"""Prompts that are too long for the engine, found when the data is loaded, in tokens.

The bound is the number of tokens the engine leaves a prompt (``asyncrl.tasks.prompts.load_run_prompts``
says why it is ``engine.max_model_len - sampling.max_tokens``), measured with the policy model's
tokenizer exactly as the engine will tokenize the rendered text. A prompt over it is, by
``task.long_prompts``:

- ``drop`` (the default): left out. The dropped rows are counted and logged once, with their ids,
  so a data set that does not fit the engine is visible before the first step, never a crash.
- ``truncate``: the question is cut from its start, token by token, until the rendered prompt
  fits. The end is kept because that is where a word problem asks its question ("How many ...?")
  and the template and chat template (system turn, the generation prompt the answer follows)
  stay whole, since only the question is cut. This differs from verl's ``truncation: left``,
  which cuts the rendered prompt and so the system turn and chat header first. A prompt whose
  template alone leaves no room is dropped all the same.

A generator still guards against what slips through (another tokenizer, a changed bound): a
prompt the engine would refuse is dropped there with reason ``prompt_too_long``
(``asyncrl.generators.process``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

log = logging.getLogger(__name__)

LONG_PROMPT_POLICIES = ("drop", "truncate")
LOGGED_IDS = 200
"""Row ids written in the one log line per outcome; past that the line says how many more."""


def count_tokens(tokenizer, texts: list[str]) -> list[int]:
    """Tokens of each text as the engine counts them (special tokens added, as ``encode`` does)."""
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts)["input_ids"]]


def truncate_question(question: str, formatter, tokenizer, max_tokens: int) -> str | None:
    """The prompt rendered from the end of ``question`` that fits in ``max_tokens``, or None when
    even an empty question would not (the template alone is too long)."""
    ids = tokenizer.encode(question, add_special_tokens=False)
    text = formatter(question)
    over = count_tokens(tokenizer, [text])[0] - max_tokens
    while over > 0:
        if over >= len(ids):
            return None
        # Token boundaries can move when the text is re-encoded: measure again until it fits.
        ids = ids[over:]
        text = formatter(tokenizer.decode(ids))
        over = count_tokens(tokenizer, [text])[0] - max_tokens
    return text


def fit_prompts(questions: list, formatter, tokenizer, max_tokens: int, policy: str, split: str) -> list:
    """Render each prompt (``questions``: ``Prompt``s whose text is the bare question) and keep
    those of at most ``max_tokens`` tokens, dropping or truncating the others by ``policy``."""
    if policy not in LONG_PROMPT_POLICIES:
        raise ValueError(f"long_prompts ({policy!r}) must be one of {LONG_PROMPT_POLICIES}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1")
    texts = [formatter(q.text) for q in questions]
    kept, dropped, truncated = [], [], []
    for question, text, length in zip(questions, texts, count_tokens(tokenizer, texts)):
        if length <= max_tokens:
            kept.append(replace(question, text=text))
            continue
        cut = truncate_question(question.text, formatter, tokenizer, max_tokens) if policy == "truncate" else None
        if cut is None:
            dropped.append(question.prompt_uid)
        else:
            kept.append(replace(question, text=cut))
            truncated.append(question.prompt_uid)
    for outcome, ids in (("dropped", dropped), ("truncated (question cut from its start)", truncated)):
        if ids:
            log.warning(
                "%s: %s %d of %d prompts longer than %d tokens (task.long_prompts: %s): %s",
                split,
                outcome,
                len(ids),
                len(questions),
                max_tokens,
                policy,
                describe_ids(ids),
            )
    return kept


def describe_ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:LOGGED_IDS])
    return shown if len(ids) <= LOGGED_IDS else f"{shown} and {len(ids) - LOGGED_IDS} more"
