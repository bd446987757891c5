"""Rows -> token ids with a mask of the tokens to learn: chats, prompt/response columns, pairs.

A row is a chat (``messages``: ``[{role, content}, ...]``), a prompt/response pair of columns
(one user turn, one assistant turn, after an optional system turn), or a preference pair (a
prompt, a chosen and a rejected response; each response text or turns). Each becomes an
``Example``: its sequences (SFT: one; DPO: the chosen one, then the rejected one), the prompt
a greedy answer is decoded from, and the reference answer that answer is scored against.

Rendering (``ChatRenderer``) follows the model's chat template, turn by turn, and tokenises each
piece on its own, as a generator sees a conversation (the prompt's ids, then the ids it samples):

    context_k = render(turns[:k], add_generation_prompt=True)   # up to the k-th assistant turn
    full_k    = render(turns[:k+1])                             # with it

The text between ``full_{k-1}`` and ``context_k`` is context (mask 0: system and user turns,
the template's role headers); the text between ``context_k`` and ``full_k`` is the assistant's
(mask 1) up to and including the tokenizer's eos (the template's end of turn), whatever the
template adds after eos being context again. A template for which ``context_k`` does not extend
``full_{k-1}`` (one that rewrites earlier turns) is refused with the turn it failed at. Without
a template (``chat_template: none``, or ``auto`` and a tokenizer without one: the tiny model) the
turns' texts follow each other, each assistant turn closed by eos, as the RL warm start learns
prompt + answer + eos. An assistant piece without eos is closed by one, so the model learns to stop.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configbase import UserKeyError, UserValueError
from asyncrl.learner.offline.config import OfflineDataConfig
from asyncrl.models.sft import TokenExample
from asyncrl.tasks.prompts import REPO_ROOT, addition_prompts
from asyncrl.tasks.sources import answer_of, read_hf_rows, read_rows, resolve_path

log = logging.getLogger(__name__)

ADDITION = "addition"
"""``data.train: addition``: the demo task's rows, generated (``addition_rows``)."""
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One training or held-out example."""

    uid: str
    sequences: tuple[TokenExample, ...]
    """SFT: the conversation; DPO: (chosen, rejected), the same prompt first in both."""
    prompt_ids: list[int]
    """The context the (last) answer follows, ending where the model starts answering."""
    answer: str
    """The reference answer exact match scores a greedy answer against ("" when none)."""

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.sequences)


class ChatRenderer:
    """Turns -> ``TokenExample`` with the model's chat template, or plain text (see the module)."""

    def __init__(self, tokenizer, chat_template: str = "auto"):
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer ({type(tokenizer).__name__}) must define an eos token")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "model" and not has_template:
            raise UserValueError(
                f"data.chat_template is 'model' but the tokenizer ({tokenizer.name_or_path}) has no chat template: "
                "use 'none' (plain text) or a model with one"
            )
        self.tokenizer = tokenizer
        self.templated = has_template and chat_template != "none"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def render(self, turns: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    def conversation(self, turns: list[dict], learn: str = "all") -> tuple[TokenExample, list[int]]:
        """(the conversation with its mask, the prompt ids before its last assistant turn).

        ``learn``: 'all' assistant turns, or only the 'last' (a DPO response)."""
        check_turns(turns)
        last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
        ids: list[int] = []
        mask: list[int] = []
        prompt_ids: list[int] = []
        done = ""  # the text rendered so far (templated)
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant":
                if not self.templated:
                    piece = self.encode(turn["content"])
                    ids += piece
                    mask += [0] * len(piece)
                continue
            if self.templated:
                context, full = self.render(turns[:k], True), self.render(turns[: k + 1], False)
                if not context.startswith(done) or not full.startswith(context):
                    raise UserValueError(
                        f"the chat template does not extend the conversation turn by turn at turn {k} "
                        "(it rewrites earlier turns); give single-turn rows or another template"
                    )
                head = self.encode(context[len(done) :])
                ids += head
                mask += [0] * len(head)
                answer_text, tail_text = split_after_eos(full[len(context) :], self.tokenizer.eos_token)
                done = full
            else:
                answer_text, tail_text = turn["content"], ""
            if k == last:
                prompt_ids = list(ids)
            answer = self.encode(answer_text)
            if self.tokenizer.eos_token_id not in answer[-1:]:
                answer.append(self.tokenizer.eos_token_id)
            tail = self.encode(tail_text)
            learned = learn == "all" or k == last
            ids += answer + tail
            mask += [int(learned)] * len(answer) + [0] * len(tail)
        if self.templated:
            rest = self.encode(self.render(turns, False)[len(done) :])
            ids += rest
            mask += [0] * len(rest)
        return TokenExample(ids, mask), prompt_ids


def split_after_eos(text: str, eos: str | None) -> tuple[str, str]:
    """(the text up to and including the last eos, what follows it); no eos: (text, "")."""
    if not eos or eos not in text:
        return text, ""
    cut = text.rindex(eos) + len(eos)
    return text[:cut], text[cut:]


def check_turns(turns) -> None:
    if not isinstance(turns, list) or not turns:
        raise UserValueError(f"a chat must be a non-empty list of turns, got {turns!r:.80}")
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise UserValueError(f"turn {turn!r:.80} must be {{role: one of {ROLES}, content: text}}")
    if turns[-1]["role"] != "assistant":
        raise UserValueError(f"a chat must end with an assistant turn, not {turns[-1]['role']!r}")


# ---------------------------------------------------------------------------------------------
# rows


def addition_rows(cfg: OfflineDataConfig, split: str, seed: int, pairs: bool) -> list[dict]:
    """The demo task's rows: ``{prompt: "07+45=", response: "52"}`` (with ``pairs``: ``chosen``
    the right sum, ``rejected`` a wrong one, off by 1-10 or any other sum, seeded), the held-out
    split being addition's own (``task.test_size``'s permutation, seed 0, 500 rows), never trained on."""
    rng = random.Random(seed + (split == "test"))
    rows = []
    for prompt in addition_prompts(500, 0, split):
        row = {"uid": prompt.prompt_uid, "prompt": prompt.text, "response": prompt.answer}
        if pairs:
            right = int(prompt.answer)
            if cfg.addition_wrong == "near":
                wrong = right + rng.choice([d for d in range(-10, 11) if d and right + d >= 0])
            else:
                wrong = rng.choice([s for s in range(199) if s != right])
            row = {"uid": row["uid"], "prompt": prompt.text, "chosen": str(right), "rejected": str(wrong)}
        rows.append(row)
    if split == "train":
        rng.shuffle(rows)
    return rows


def source_rows(source: str, cfg: OfflineDataConfig, split: str) -> list[dict]:
    if source.startswith("hf://"):
        return read_hf_rows(source, split)
    return read_rows(resolve_path(source, REPO_ROOT), cfg.format, split)


def load_rows(cfg: OfflineDataConfig, seed: int, pairs: bool) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): ``data.test``'s first ``test_size``, or the last ``test_size``
    of ``data.train`` (then taken out of training)."""
    if cfg.train == ADDITION:
        train = addition_rows(cfg, "train", seed, pairs)
        test = addition_rows(cfg, "test", seed, pairs)[: cfg.test_size]
    else:
        train = source_rows(cfg.train, cfg, "train")
        if cfg.test is not None:
            test = source_rows(cfg.test, cfg, "test")[: cfg.test_size]
        else:
            if len(train) <= cfg.test_size:
                raise UserValueError(
                    f"data.train ({cfg.train}) has {len(train)} rows, not more than data.test_size ({cfg.test_size}): "
                    "hold out fewer, or give data.test"
                )
            train, test = train[: -cfg.test_size], train[-cfg.test_size :]
    if cfg.max_train_rows is not None:
        train = train[: cfg.max_train_rows]
    return train, test


def row_turns(row: dict, cfg: OfflineDataConfig, where: str) -> list[dict]:
    """A row's chat: its ``messages`` column, or [system?, user: prompt, assistant: response]."""
    if cfg.messages_key in row:
        return row[cfg.messages_key]
    return prompt_turns(row, cfg, where) + [{"role": "assistant", "content": _text(row, cfg.response_key, where)}]


def prompt_turns(row: dict, cfg: OfflineDataConfig, where: str) -> list[dict]:
    prompt = row.get(cfg.prompt_key)
    if isinstance(prompt, list):  # already turns
        return prompt
    turns = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    text = cfg.prompt_template.replace("{prompt}", _text(row, cfg.prompt_key, where))
    return turns + [{"role": "user", "content": text}]


def _text(row: dict, key: str, where: str) -> str:
    if key not in row:
        raise UserKeyError(f"{where}: no column {key!r} (it has {sorted(row)}); set data.{_key_name(key)}")
    value = row[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise UserValueError(f"{where}: {key!r} ({value!r:.60}) must be a non-empty string")
    return value


def _key_name(key: str) -> str:
    return {"prompt": "prompt_key", "response": "response_key", "chosen": "chosen_key"}.get(key, "..._key")


def response_turns(row: dict, key: str, where: str) -> list[dict]:
    value = row.get(key)
    if isinstance(value, list):
        return value
    return [{"role": "assistant", "content": _text(row, key, where)}]


def sft_example(row: dict, index: int, cfg: OfflineDataConfig, renderer: ChatRenderer, where: str) -> Example:
    at = f"{where} row {index}"
    turns = row_turns(row, cfg, at)
    seq, prompt_ids = renderer.conversation(turns)
    answer = row[cfg.answer_key] if cfg.answer_key is not None else turns[-1]["content"]
    return Example(str(row.get("uid", f"{where}/{index}")), (seq,), prompt_ids, answer_of(answer))


def pair_example(row: dict, index: int, cfg: OfflineDataConfig, renderer: ChatRenderer, where: str) -> Example:
    at = f"{where} row {index}"
    chosen, rejected = response_turns(row, cfg.chosen_key, at), response_turns(row, cfg.rejected_key, at)
    if cfg.prompt_key in row:
        prompt = prompt_turns(row, cfg, at)
    else:  # conversational pairs with an implicit prompt: the turns both share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    good, prompt_ids = renderer.conversation(prompt + chosen, learn="last")
    bad, bad_prompt = renderer.conversation(prompt + rejected, learn="last")
    if bad_prompt != prompt_ids:
        raise UserValueError(f"{at}: the chosen and rejected responses do not share their prompt's tokens")
    answer = row[cfg.answer_key] if cfg.answer_key is not None else chosen[-1]["content"]
    return Example(str(row.get("uid", f"{where}/{index}")), (good, bad), prompt_ids, answer_of(answer))


def build_examples(
    rows: list[dict], cfg: OfflineDataConfig, renderer: ChatRenderer, pairs: bool, where: str
) -> list[Example]:
    """Every row as an ``Example``; those longer than ``data.max_tokens`` (a sequence) are dropped
    and counted in one log line."""
    make = pair_example if pairs else sft_example
    examples, dropped = [], 0
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserValueError(f"{where} row {index}: a row must be a mapping of columns, got {type(row).__name__}")
        example = make(row, index, cfg, renderer, where)
        if max(len(s.ids) for s in example.sequences) > cfg.max_tokens:
            dropped += 1
            continue
        examples.append(example)
    if dropped:
        log.warning(
            "%s: %d of %d rows dropped, longer than data.max_tokens (%d)", where, dropped, len(rows), cfg.max_tokens
        )
    if not examples:
        raise UserValueError(f"{where}: no example of at most data.max_tokens ({cfg.max_tokens}) tokens")
    return examples


def write_rows(rows: list[dict], path: Path) -> None:
    """Rows as JSONL (the generated data is kept in the run directory for inspection)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
