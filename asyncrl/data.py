"""Prompt files: JSONL, Parquet or a Hugging Face dataset saved on disk, turned into prompts.

``task.data`` names a train and a test source; each row gives a question and a reference answer
under configurable keys (``question_key``, ``answer_key``). The prompt text is
``prompt_template`` with ``{question}`` filled in, then, when ``chat_template`` names a model
directory whose tokenizer has a chat template, wrapped by ``tokenizer.apply_chat_template`` as
one user turn (after an optional system turn), so an instruction-tuned model sees what it was
tuned on. An answer written GSM8K-style (``... #### 42``) keeps the number after ``####``.

Formats are read by their own libraries: ``json`` line by line, ``pyarrow.parquet``, and
``datasets.load_from_disk`` for a folder written by ``save_to_disk`` (nothing is downloaded).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import field_validator

from asyncrl.configbase import Config

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet", "hf")


class DataConfig(Config):
    """Where a task's prompts come from when they are not built in, and how rows become prompts."""

    train: str | None = None
    """Training prompts: a .jsonl or .parquet file, or a folder written by datasets' save_to_disk (None: the task's own)."""
    test: str | None = None
    """Held-out prompts, same forms as ``train`` (None: the task's own, or the train source's 'test' split)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """File format; 'auto' goes by the suffix (.jsonl/.json, .parquet) and treats a folder as a saved dataset."""
    question_key: str = "question"
    """Column (key) of each row holding the question."""
    answer_key: str = "answer"
    """Column (key) of each row holding the reference answer."""
    prompt_template: str | None = None
    """Prompt text with ``{question}`` in it, e.g. 'Question: {question}\\nAnswer:' (None: the task's own; plain question for files)."""
    chat_template: str | None = None
    """A model directory whose tokenizer's chat template wraps each prompt as a user turn (None: no chat template)."""
    system_prompt: str | None = None
    """System turn placed before the question when a chat template is applied."""

    @field_validator("prompt_template")
    @classmethod
    def check_prompt_template(cls, value: str | None) -> str | None:
        if value is not None and "{question}" not in value:
            raise ValueError(f"prompt_template ({value!r}) must contain {{question}}")
        return value

    @field_validator("question_key", "answer_key")
    @classmethod
    def check_key(cls, value: str) -> str:
        if not value:
            raise ValueError(f"a column key ({value!r}) must be a non-empty string")
        return value


def resolve_path(path: str, root: Path) -> Path:
    """``path`` as given if it exists, else relative to ``root`` (the repo), so recipes run from anywhere."""
    given = Path(path)
    if given.exists():
        return given
    if (root / path).exists():
        return root / path
    raise FileNotFoundError(f"data file ({path!r}) exists neither from {Path.cwd()} nor from {root}")


def detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "hf"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise ValueError(
        f"data format of {path} (suffix {path.suffix!r}) is unknown: set task.data.format to one of {FORMATS}"
    )


def read_rows(path: Path, fmt: str = "auto", split: str = "train", need_split: bool = False) -> list[dict]:
    """Every row of a JSONL file, a Parquet file, or one split of a saved Hugging Face dataset
    (``need_split``: the dataset must have that split, a single one will not do)."""
    fmt = detect_format(path, fmt)
    if fmt == "jsonl":
        with path.open() as lines:
            return [json.loads(line) for line in lines if line.strip()]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    try:
        import datasets
    except ImportError as e:  # an optional reader: say what to install
        raise ImportError(f"{path} is a Hugging Face dataset folder: reading it needs `pip install datasets`") from e
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise KeyError(f"dataset {path} has no split {split!r}; it has {sorted(loaded)}")
        loaded = loaded[split]
    elif need_split:
        raise ValueError(f"dataset {path} is a single split, not a DatasetDict with {split!r}: set task.data.{split}")
    return loaded.to_list()


def answer_of(raw) -> str:
    """The reference answer: the number after the last ``####`` when written GSM8K-style, else the text."""
    from asyncrl.tasks import extract_gsm8k_answer

    text = str(raw)
    if "####" in text:
        number = extract_gsm8k_answer(text)
        if number is not None:
            return number
    return text.strip()


class PromptFormatter:
    """Question -> prompt text: the template, then the chat template of a tokenizer when asked
    for and when the tokenizer has one (a model without one gets the plain text, with a warning)."""

    def __init__(self, cfg: DataConfig, default_template: str = "{question}"):
        self.template = cfg.prompt_template or default_template
        self.system_prompt = cfg.system_prompt
        self.tokenizer = None
        if cfg.chat_template is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(cfg.chat_template)
            if getattr(tokenizer, "chat_template", None):
                self.tokenizer = tokenizer
            else:
                log.warning("the tokenizer of %s has no chat template: prompts stay plain text", cfg.chat_template)

    def __call__(self, question: str) -> str:
        text = self.template.format(question=question)
        if self.tokenizer is None:
            return text
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": text})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
