"""Prompts with reference answers for training and evaluation, and the exact-match score.

Two tasks:

* ``addition``: ``"07+45="`` -> ``"52"``. All 10,000 two-digit pairs, zero padded so every
  prompt is six characters; a seeded permutation picks a held-out test split that never
  overlaps train. It needs no download and a tiny character-level model learns it in seconds,
  which is what tests and demos need.
* ``gsm8k``: grade-school word problems (``{"question", "answer"}``, the final answer after
  ``####``), by default the copy shipped in ``data/gsm8k`` (7,473 train / 1,319 test rows, MIT),
  read by the same reader as any other file (its checksums checked).

The task's name picks the scoring rule of ``exact_match`` (addition: the exact string; gsm8k: the
number; see ``asyncrl.tasks.answers``). Either task can take its prompts from elsewhere
(``task.data``: JSONL, Parquet, a Hugging Face dataset saved on disk or named on the Hub, with
configurable keys, a prompt template and an optional chat template; see ``asyncrl.tasks.sources``).

Any other name is a task of the user's: ``task.data`` says where its rows are, which column is the
prompt and which (if any) the reference answer. Every row's columns travel with its prompt to the
reward worker (``Prompt.columns``), so a reward function reads whatever fields it needs, and
``task.metadata`` is handed to it too. Several sources mix by weight with ``task.sources``
(``asyncrl.tasks.mixture``).

``score_answer`` is a pure function so the reward worker can call it on any process.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config, UserValueError
from asyncrl.tasks.answers import extract_gsm8k_answer
from asyncrl.tasks.formatting import TOKENIZER_FILES, PromptFormatter
from asyncrl.tasks.mixture import PRESETS, SourceConfig, check_task_name, interleave
from asyncrl.tasks.prompt_length import fit_prompts
from asyncrl.tasks.prompt_tokenizer import load_prompt_tokenizer
from asyncrl.tasks.sources import (
    HF_PREFIX,
    DataConfig,
    answer_of,
    parse_hf_source,
    read_hf_rows,
    read_rows,
    resolve_path,
    row_columns,
    row_fields,
    source_stem,
)

GSM8K_TEMPLATE = "Question: {question}\nAnswer:"
ADDITION_SIZE = 100 * 100  # every (a, b) with 0 <= a, b <= 99
REPO_ROOT = Path(__file__).resolve().parents[2]  # asyncrl/tasks/prompts.py -> the checkout
GSM8K_FILES = {"train": "data/gsm8k/train.jsonl.gz", "test": "data/gsm8k/test.jsonl.gz"}
"""GSM8K as shipped in the repository (MIT; data/gsm8k/README.md), relative to its root."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable id, the text the model sees, the reference answer ("" when the task
    has none), its task, and the columns of the row it came from (None: a generated prompt)."""

    prompt_uid: str
    text: str
    answer: str
    task: str
    columns: dict[str, Any] | None = None


class TaskConfig(Config):
    """Which task to train and evaluate on, and how its splits are made."""

    name: str = "addition"
    """Task: 'addition' (two-digit sums, generated), 'gsm8k' (word problems; by default the copy
    shipped in data/gsm8k), or any name for prompts of your own (``data.train`` then required)."""
    test_size: int = 500
    """Held-out prompts: addition's seeded test split size; for files, the first test_size rows of the test source."""
    seed: int = 0
    """Seed of the permutation that picks addition's test split."""
    max_prompt_chars: int | None = None
    """Drop prompts whose text is longer than this many characters (None keeps every prompt)."""
    long_prompts: Literal["drop", "truncate"] = "drop"
    """A prompt of more tokens than the engine leaves it (engine.max_model_len - sampling.max_tokens,
    by the model's tokenizer, at load time): 'drop' (the default; counted and logged once with the
    row ids) or 'truncate' (cut the question from its start, keeping its end and the template)."""
    data: DataConfig = DataConfig()
    """Prompts from files or the Hub (JSONL, Parquet, saved or hf:// datasets), their keys and templates."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Anything the task's rewards should know (a python reward receives it as ``metadata``)."""
    sources: list[SourceConfig] = Field(default_factory=list)
    """Several sources mixed by weight, each a task of its own with its own rewards
    (``reward.by_task``) and held-out score; empty: the one task above."""

    @field_validator("name")
    @classmethod
    def check_name(cls, value: str) -> str:
        return check_task_name(value)

    @field_validator("test_size")
    @classmethod
    def check_test_size(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"test_size ({value}) must be >= 1")
        return value

    @field_validator("max_prompt_chars")
    @classmethod
    def check_max_prompt_chars(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_prompt_chars ({value}) must be >= 1 or None")
        return value

    @model_validator(mode="after")
    def check_addition_split(self) -> TaskConfig:
        # Train must keep at least one prompt.
        if "addition" in self.task_names() and self.test_size >= ADDITION_SIZE:
            raise ValueError(f"test_size ({self.test_size}) must be < {ADDITION_SIZE} for the addition task")
        return self

    @model_validator(mode="after")
    def check_data(self) -> TaskConfig:
        """A task of the user's needs its rows; a mix takes its rows from its sources only."""
        if not self.sources:
            if self.name not in PRESETS and self.data.train is None:
                raise ValueError(
                    f"task.name ({self.name!r}) is not built in ({', '.join(PRESETS)}): set task.data.train to its prompts"
                )
            return self
        if self.data.train is not None or self.data.test is not None:
            raise ValueError("task.data.train/test must be unset with task.sources: give each source its data")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"task.sources names ({names}) must be distinct: prompts are routed by them")
        for source in self.sources:
            if source.name not in PRESETS and source.data.train is None:
                raise ValueError(
                    f"task.sources {source.name!r} is not built in ({', '.join(PRESETS)}): set its data.train"
                )
        return self

    def task_names(self) -> list[str]:
        """The task names prompts of this run carry: the sources' names, or ``name``."""
        return [s.name for s in self.sources] if self.sources else [self.name]

    def metadata_by_task(self) -> dict[str, dict]:
        """Each task's ``metadata``, by name."""
        if self.sources:
            return {s.name: dict(s.metadata) for s in self.sources}
        return {self.name: dict(self.metadata)}

    def source_tasks(self) -> list[TaskConfig]:
        """Each source as a task of its own (its name, data and metadata; the rest of this one)."""
        return [
            self.model_copy(update={"name": s.name, "data": s.data, "metadata": s.metadata, "sources": []})
            for s in self.sources
        ]


def load_prompts(
    cfg: TaskConfig, split: Literal["train", "test"], tokenizer=None, max_prompt_tokens: int | None = None
) -> list[Prompt]:
    """The prompts of one split, in a fixed order (shuffling is the caller's job).

    ``tokenizer``: the policy model's, which renders them with ``task.data.chat_template:
    model`` and, with ``max_prompt_tokens``, measures them: a prompt of more tokens is dropped
    or truncated as ``task.long_prompts`` says (``asyncrl.tasks.prompt_length``). A run loads its
    prompts through ``load_run_prompts``, which knows both.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split ({split!r}) must be 'train' or 'test'")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError(f"max_prompt_tokens ({max_prompt_tokens}) needs the tokenizer that measures prompts")
    if cfg.sources:
        # A mix: each source's prompts under ids that name it; train in source order (the
        # dispatcher draws from each by weight), test interleaved so any prefix holds every source.
        parts = [
            [
                p if p.prompt_uid.startswith(f"{task.name}/") else replace(p, prompt_uid=f"{task.name}/{p.prompt_uid}")
                for p in load_prompts(task, split, tokenizer, max_prompt_tokens)
            ]
            for task in cfg.source_tasks()
        ]
        return interleave(parts) if split == "test" else [p for part in parts for p in part]
    data = cfg.data
    source = data.train if split == "train" else (data.test or data.train)
    if source is not None:
        # Test rows from the train source only from its own test split: never train and test on the same rows.
        questions = file_questions(cfg, source, split, test_of_train=split == "test" and data.test is None)
    elif cfg.name == "gsm8k":
        # The task's own data is a file like any other, read the same way, under the task's uids.
        questions = file_questions(cfg, str(REPO_ROOT / GSM8K_FILES[split]), split, uid_prefix="gsm8k")
    else:
        questions = addition_prompts(cfg.test_size, cfg.seed, split)
    if split == "test" and (source is not None or cfg.name == "gsm8k"):
        questions = questions[: cfg.test_size]
    formatter = PromptFormatter(data, GSM8K_TEMPLATE if cfg.name == "gsm8k" else "{question}", tokenizer)
    if max_prompt_tokens is not None:
        prompts = fit_prompts(questions, formatter, tokenizer, max_prompt_tokens, cfg.long_prompts, split)
    else:
        prompts = [replace(q, text=formatter(q.text)) for q in questions]
    if cfg.max_prompt_chars is not None:
        prompts = [prompt for prompt in prompts if len(prompt.text) <= cfg.max_prompt_chars]
    return prompts


def load_run_prompts(cfg, split: Literal["train", "test"], model_dir: str | Path | None) -> list[Prompt]:
    """The prompts of a run's split as its engines will take them.

    ``cfg`` is the run's ``RunConfig``; ``model_dir`` the policy model (``model.path`` or the
    model built for the run). Its tokenizer renders the prompts (``chat_template: model``) and
    measures them against ``engine.max_model_len - sampling.max_tokens``: vLLM (0.32) refuses a
    prompt of ``max_model_len`` tokens or more, which aborts the whole batch it came in, but
    takes a shorter prompt with ``prompt + max_tokens > max_model_len`` and silently stops its
    answers at ``max_model_len`` (finish reason ``length``). Such answers would look truncated
    by the policy when the prompt is to blame, so the bound leaves every prompt the full
    ``max_tokens``. A model directory without a tokenizer (a simulated run) measures nothing.
    """
    tokenizer = None
    if model_dir is not None and any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = load_prompt_tokenizer(model_dir)
    budget = None
    if tokenizer is not None:
        budget = cfg.engine.max_model_len - cfg.sampling.max_tokens
        if budget < 1:
            raise ValueError(
                f"engine.max_model_len ({cfg.engine.max_model_len}) must exceed sampling.max_tokens "
                f"({cfg.sampling.max_tokens}): no prompt would fit"
            )
    return load_prompts(cfg.task, split, tokenizer, budget)


def file_questions(
    cfg: TaskConfig,
    source: str,
    split: Literal["train", "test"],
    uid_prefix: str | None = None,
    test_of_train: bool = False,
) -> list[Prompt]:
    """The rows of a data file, of one split of a saved dataset, or of a Hub dataset (``hf://``),
    as prompts of ``cfg.name`` whose text is still the bare question (the caller renders it);
    prompt uids are ``{uid_prefix or the source's name}/{split}/{row}``.
    ``test_of_train``: ``source`` is the train source, whose own test split must then exist."""
    data = cfg.data
    if source.startswith(HF_PREFIX):
        rows, where, name = read_hf_rows(source, split), source, parse_hf_source(source).name
    else:
        path = resolve_path(source, REPO_ROOT)
        if test_of_train and not path.is_dir():
            raise UserValueError(
                f"task.data.test is None and task.data.train ({source!r}) is a file with no test split: set both"
            )
        rows, where, name = read_rows(path, data.format, split, need_split=test_of_train), str(path), source_stem(path)
    questions = []
    for index, row in enumerate(rows):
        question, answer = row_fields(row, where, index, data.question_key, data.answer_key)
        if cfg.name == "gsm8k" and "####" in answer and extract_gsm8k_answer(answer) is None:
            raise UserValueError(f"{where} row {index}: answer {answer[-40:]!r} has no number after '####'")
        columns = row_columns(row, where, index, data.row_keys)
        uid = f"{uid_prefix or name}/{split}/{index}"
        questions.append(Prompt(uid, question, answer_of(answer) if answer else "", cfg.name, columns))
    return questions


def addition_prompts(test_size: int, seed: int, split: Literal["train", "test"]) -> list[Prompt]:
    """Two-digit addition prompts; test = the first test_size pairs of a seeded permutation."""
    order = list(range(ADDITION_SIZE))
    random.Random(seed).shuffle(order)
    test = set(order[:test_size])
    chosen = sorted(test) if split == "test" else [index for index in range(ADDITION_SIZE) if index not in test]
    return [addition_prompt(index // 100, index % 100) for index in chosen]


def addition_prompt(a: int, b: int) -> Prompt:
    """``a + b`` written as ``"07+45="`` with the unpadded sum as the answer."""
    if not (0 <= a <= 99 and 0 <= b <= 99):
        raise ValueError(f"operands ({a}, {b}) must both be in 0..99")
    expression = f"{a:02d}+{b:02d}"
    return Prompt(prompt_uid=f"addition/{expression}", text=f"{expression}=", answer=str(a + b), task="addition")
