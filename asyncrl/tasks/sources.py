"""Prompt sources: JSONL (plain or gzipped), Parquet, a saved Hugging Face dataset, or a dataset
on the Hugging Face Hub (``hf://owner/name:config``), turned into rows, then into prompts.

``task.data`` names a train and a test source; each row gives a question and a reference answer
under configurable keys (``question_key``, ``answer_key``). The prompt text is
``prompt_template`` with ``{question}`` filled in, then, with ``chat_template``, wrapped by a
tokenizer's ``apply_chat_template`` as one user turn (after an optional system turn) with the
generation prompt, so an instruction-tuned model sees what it was tuned on. An answer written
GSM8K-style (``... #### 42``) keeps the number after ``####``.

Formats are read by their own libraries: ``json`` line by line (through ``gzip`` for ``.gz``),
``pyarrow.parquet``, ``datasets.load_from_disk`` for a folder written by ``save_to_disk`` and
``datasets.load_dataset`` for ``hf://`` names, the only source that downloads. Offline (no
network, or ``HF_DATASETS_OFFLINE=1``) an ``hf://`` source fails at once, saying how to put the
data on disk, instead of waiting on retries. A ``SHA256SUMS`` file beside a data file (as
``sha256sum`` writes it) is checked before the file is read: a damaged or edited copy of the data
a recipe names is an error, not a silent change of the task.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import field_validator

from asyncrl.configbase import Config, UserConnectionError, UserFileError, UserKeyError, UserValueError

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet", "hf")
HF_PREFIX = "hf://"
CHECKSUMS = "SHA256SUMS"
MODEL_CHAT_TEMPLATE = "model"
"""``chat_template: model``: the policy model's own tokenizer renders the prompts."""


class DataConfig(Config):
    """Where a task's prompts come from when they are not its own, and how rows become prompts."""

    train: str | None = None
    """Training prompts: a .jsonl / .jsonl.gz / .parquet file, a folder written by datasets'
    save_to_disk, or 'hf://owner/name:config' (downloaded, online only). None: the task's own
    (addition: generated; gsm8k: the copy shipped in data/gsm8k)."""
    test: str | None = None
    """Held-out prompts, same forms as ``train`` (None: the task's own, or the train source's 'test' split)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """File format; 'auto' goes by the suffix (.jsonl/.json, optionally .gz; .parquet) and treats a folder as a saved dataset."""
    question_key: str = "question"
    """Column (key) of each row holding the question."""
    answer_key: str | None = "answer"
    """Column (key) of each row holding the reference answer; None: the rows have none (a task
    whose rewards need no reference, e.g. a python reward that reads other columns)."""
    row_keys: list[str] | None = None
    """Columns of each row passed on with its prompt to the rewards (a python reward's ``row``);
    None: every column. Their values must be JSON values (text, numbers, lists, maps)."""
    prompt_template: str | None = None
    """Prompt text with ``{question}`` in it, e.g. 'Question: {question}\\nAnswer:' (None: the task's own; plain question for files)."""
    chat_template: str | None = None
    """Render prompts with a chat template: 'model' (the policy model's own tokenizer), or a
    directory holding a tokenizer with one. None: plain text, no chat template."""
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
    def check_key(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError(f"a column key ({value!r}) must be a non-empty string")
        return value

    @field_validator("train", "test")
    @classmethod
    def check_source(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(HF_PREFIX):
            parse_hf_source(value)
        return value


# ---------------------------------------------------------------------------------------------
# files on disk


def resolve_path(path: str, root: Path) -> Path:
    """``path`` as given if it exists, else relative to ``root`` (the repo), so recipes run from anywhere."""
    given = Path(path)
    if given.exists():
        return given
    if (root / path).exists():
        return root / path
    raise UserFileError(f"data file ({path!r}) exists neither from {Path.cwd()} nor from {root}")


def detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "hf"
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    if suffixes and suffixes[0] in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise UserValueError(
        f"data format of {path} (suffix {''.join(suffixes)!r}) is unknown: set task.data.format to one of {FORMATS}"
    )


def source_stem(path: Path) -> str:
    """``train.jsonl.gz`` -> ``train``: a file's name without its format suffixes (prompt uids use it)."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name


def verify_checksum(path: Path) -> None:
    """Check ``path`` against the ``SHA256SUMS`` beside it, when there is one that lists it."""
    sums = path.parent / CHECKSUMS
    if not path.is_file() or not sums.is_file():
        return
    expected = None
    for line in sums.read_text().splitlines():
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == path.name:
            expected = digest.lower()
    if expected is None:
        return
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected:
        raise UserValueError(
            f"{path}: sha256 {actual} does not match {expected} in {sums}: the file is damaged or changed "
            f"(restore it, or write its new checksum there on purpose)"
        )


def read_jsonl(path: Path) -> list:
    """Every non-blank line of a JSONL file (gzipped when it ends in .gz) as a JSON value."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserValueError(f"{path} line {number} (row {len(rows)}): not JSON: {e}") from e
    return rows


def read_rows(path: Path, fmt: str = "auto", split: str = "train", need_split: bool = False) -> list[dict]:
    """Every row of a JSONL file, a Parquet file, or one split of a saved Hugging Face dataset
    (``need_split``: the dataset must have that split, a single one will not do)."""
    fmt = detect_format(path, fmt)
    verify_checksum(path)
    if fmt == "jsonl":
        return read_jsonl(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserKeyError(f"dataset {path} has no split {split!r}; it has {sorted(loaded)}")
        loaded = loaded[split]
    elif need_split:
        raise UserValueError(
            f"dataset {path} is a single split, not a DatasetDict with {split!r}: set task.data.{split}"
        )
    return loaded.to_list()


# ---------------------------------------------------------------------------------------------
# datasets on the Hugging Face Hub


@dataclass(frozen=True)
class HFSource:
    """``hf://openai/gsm8k:main`` -> name 'openai/gsm8k', config 'main' (None when not given)."""

    name: str
    config: str | None = None


def parse_hf_source(source: str) -> HFSource:
    """Split ``hf://NAME[:CONFIG]``; the split comes from where the source is used (train/test)."""
    if not source.startswith(HF_PREFIX):
        raise ValueError(f"data source ({source!r}) is not a Hugging Face name: it must start with {HF_PREFIX!r}")
    name, _, config = source[len(HF_PREFIX) :].partition(":")
    parts = name.split("/")
    if not name or len(parts) > 2 or not all(parts) or any(c.isspace() for c in name):
        raise ValueError(f"data source ({source!r}) must look like hf://owner/name or hf://owner/name:config")
    if ":" in source[len(HF_PREFIX) :] and not config:
        raise ValueError(f"data source ({source!r}) has an empty config after ':'")
    return HFSource(name, config or None)


def hf_offline_reason(timeout_s: float = 3.0) -> str | None:
    """Why the Hub cannot be reached from here, or None when it answers a TCP connect within
    ``timeout_s`` (the endpoint is ``HF_ENDPOINT``, as ``datasets`` uses it)."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or endpoint, port), timeout=timeout_s).close()
    except OSError as e:
        return f"no connection to {endpoint} ({e})"
    return None


def read_hf_rows(source: str, split: str) -> list[dict]:
    """One split of a Hub dataset through ``datasets.load_dataset``; offline, an error at once."""
    hf = parse_hf_source(source)
    reason = hf_offline_reason()
    if reason is not None:
        args = f'"{hf.name}"' + (f', "{hf.config}"' if hf.config else "")
        folder = "data/" + hf.name.replace("/", "--") + (f"--{hf.config}" if hf.config else "")
        raise UserConnectionError(
            f"task.data source {source!r} needs the Hugging Face Hub, which is out of reach ({reason}). "
            f"On a machine online, save it: python -c 'import datasets; datasets.load_dataset({args})"
            f'.save_to_disk("{folder}")\'; copy that folder here and set task.data.train to it '
            f"(its test split serves task.data.test)"
        )
    import datasets

    return datasets.load_dataset(hf.name, hf.config, split=split).to_list()


# ---------------------------------------------------------------------------------------------
# rows -> question and answer


def answer_of(raw) -> str:
    """The reference answer: the number after the last ``####`` when written GSM8K-style, else the text."""
    from asyncrl.tasks.answers import extract_gsm8k_answer

    text = str(raw)
    if "####" in text:
        number = extract_gsm8k_answer(text)
        if number is not None:
            return number
    return text.strip()


def row_fields(row, where: str, index: int, question_key: str, answer_key: str | None) -> tuple[str, str]:
    """(question, answer text) of one row, or an error naming the source, the row and what is wrong:
    a row that is not a mapping, a missing column, a question that is not a non-empty string, an
    answer that is not a non-empty string or a number. ``answer_key`` None: no answer ("")."""
    if not isinstance(row, dict):
        raise UserValueError(f"{where} row {index}: a row must be a mapping of columns, got {type(row).__name__}")
    missing = [k for k in (question_key, answer_key) if k is not None and k not in row]
    if missing:
        raise UserKeyError(
            f"{where} row {index}: no column {missing} (it has {sorted(row)}); set task.data.question_key/answer_key"
        )
    question = row[question_key]
    if not isinstance(question, str) or not question.strip():
        raise UserValueError(
            f"{where} row {index}: question {question_key!r} ({question!r:.60}) must be a non-empty string"
        )
    if answer_key is None:
        return question, ""
    answer = row[answer_key]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise UserValueError(
            f"{where} row {index}: answer {answer_key!r} ({answer!r:.60}) must be a non-empty string or a number"
        )
    return question, str(answer)


def _is_json(value, depth: int = 0) -> bool:
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if depth > 32:
        return False
    if isinstance(value, (list, tuple)):
        return all(_is_json(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v, depth + 1) for k, v in value.items())
    return False


def row_columns(row: dict, where: str, index: int, keys: list[str] | None) -> dict:
    """The columns of a row that travel with its prompt (``keys``; None: all), checked to be JSON
    values: they go in messages and in the dispatcher's checkpoint."""
    if keys is None:
        keys = list(row)
    missing = [k for k in keys if k not in row]
    if missing:
        raise UserKeyError(f"{where} row {index}: no column {missing} (it has {sorted(row)}); set task.data.row_keys")
    for key in keys:
        if not _is_json(row[key]):
            raise UserValueError(
                f"{where} row {index}: column {key!r} holds a {type(row[key]).__name__}, not a JSON value "
                f"(text, number, list, map): set task.data.row_keys to the columns the rewards read"
            )
    return {k: list(row[k]) if isinstance(row[k], tuple) else row[k] for k in keys}


# ---------------------------------------------------------------------------------------------
# question -> prompt text
