"""Prompt sources (JSONL plain or gzipped, Parquet, saved and hf:// datasets, the shipped GSM8K),
checksums, bad rows, keys, templates, chat templates."""

import gzip
import hashlib
import json
import re
import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncrl.configbase import load_yaml
from asyncrl.tasks.prompts import GSM8K_FILES, REPO_ROOT, TaskConfig, load_prompts
from asyncrl.tasks.sources import DataConfig, HFSource, answer_of, parse_hf_source, read_rows

ROWS = [
    {"q": "What is 2+3?", "a": "5", "extra": 1},
    {"q": "Half of 10?", "a": "so 10 / 2 = 5\n#### 5", "extra": 2},
    {"q": "Ten times 100?", "a": "#### 1,000", "extra": 3},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_jsonl_parquet_and_saved_dataset_read_the_same_rows(tmp_path):
    import datasets

    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    parquet = write_parquet(tmp_path / "p.parquet", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert read_rows(jsonl) == read_rows(parquet) == read_rows(tmp_path / "ds") == ROWS


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_file_prompts_with_keys_and_template(tmp_path, kind):
    train = (write_jsonl if kind == "jsonl" else write_parquet)(tmp_path / f"train.{kind}", ROWS)
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[:2])
    cfg = TaskConfig(
        name="gsm8k",
        data=DataConfig(
            train=str(train), test=str(test), question_key="q", answer_key="a", prompt_template="Q: {question}\nA:"
        ),
    )
    prompts = load_prompts(cfg, "train")
    assert [p.answer for p in prompts] == ["5", "5", "1000"]  # GSM8K-style answers keep the number after ####
    assert prompts[0].text == "Q: What is 2+3?\nA:" and prompts[0].task == "gsm8k"
    assert prompts[0].prompt_uid == "train/train/0"
    assert len(load_prompts(cfg, "test")) == 2


def test_dataset_dict_splits_serve_train_and_test(tmp_path):
    import datasets

    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])})
    ds.save_to_disk(str(tmp_path / "dd"))
    cfg = TaskConfig(data=DataConfig(train=str(tmp_path / "dd"), question_key="q", answer_key="a"))
    assert len(load_prompts(cfg, "train")) == 3
    test = load_prompts(cfg, "test")
    assert [(p.text, p.answer, p.task) for p in test] == [("What is 2+3?", "5", "addition")]


def test_a_single_split_dataset_does_not_serve_as_its_own_test_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    cfg = TaskConfig(data=DataConfig(train=str(tmp_path / "ds"), question_key="q", answer_key="a"))
    assert len(load_prompts(cfg, "train")) == 3
    with pytest.raises(ValueError, match="is a single split.*set task.data.test"):
        load_prompts(cfg, "test")


def test_missing_key_names_the_column_and_the_setting(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = TaskConfig(data=DataConfig(train=str(train), test=str(train)))
    with pytest.raises(KeyError, match=r"no column \['question', 'answer'\].*question_key"):
        load_prompts(cfg, "train")


def test_a_file_without_test_split_needs_data_test(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(ValueError, match="task.data.test is None"):
        load_prompts(TaskConfig(data=DataConfig(train=str(train), question_key="q", answer_key="a")), "test")


def test_unknown_suffix_and_bad_template_are_named(tmp_path):
    (tmp_path / "rows.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match=r"suffix '.csv'.*task.data.format"):
        read_rows(tmp_path / "rows.csv")
    with pytest.raises(ValidationError, match=r"prompt_template \('Q:'\) must contain \{question\}"):
        DataConfig(prompt_template="Q:")


def test_chat_template_wraps_prompts_when_the_model_has_one(tmp_path):
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    plain_dir, chat_dir = tmp_path / "plain", tmp_path / "chat"
    tok = build_char_tokenizer(plain_dir)  # the tiny model's tokenizer: no chat template
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    tok.save_pretrained(chat_dir)
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    data = dict(train=str(train), test=str(train), question_key="q", answer_key="a")
    chat = load_prompts(
        TaskConfig(data=DataConfig(**data, chat_template=str(chat_dir), system_prompt="Be brief.")), "train"
    )
    assert chat[0].text == "<system>Be brief.<user>What is 2+3?<assistant>"
    plain = load_prompts(TaskConfig(data=DataConfig(**data, chat_template=str(plain_dir))), "train")
    assert plain[0].text == "What is 2+3?"  # no chat template in that tokenizer: the text as is


CHATML = (
    "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template like Qwen2.5's: a system turn (a default one when none is given) and the
generation prompt the answer follows."""


def test_chat_template_model_renders_with_the_policy_models_tokenizer(tmp_path):
    from asyncrl.config import RunConfig
    from asyncrl.models.char_tokenizer import build_char_tokenizer
    from asyncrl.tasks.prompts import load_run_prompts

    tok = build_char_tokenizer(tmp_path / "policy")
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "policy")
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    data = dict(train=str(train), test=str(train), question_key="q", answer_key="a", chat_template="model")
    run = {"engine": {"max_model_len": 512}, "sampling": {"max_tokens": 16}}
    cfg = RunConfig.model_validate({"task": {"name": "gsm8k", "data": {**data, "system_prompt": "Be brief."}}, **run})
    prompts = load_run_prompts(cfg, "train", tmp_path / "policy")
    assert prompts[0].text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nQuestion: What is 2+3?\nAnswer:<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert [p.answer for p in prompts] == ["5", "5", "1000"]
    cfg = RunConfig.model_validate({"task": {"name": "gsm8k", "data": data}, **run})
    assert load_run_prompts(cfg, "test", tmp_path / "policy")[1].text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"  # the template's own system turn
        "<|im_start|>user\nQuestion: Half of 10?\nAnswer:<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(
        ValueError, match=r"chat_template \('model'\) renders prompts with the policy model's tokenizer"
    ):
        load_prompts(cfg.task, "train")  # no model here to take it from


def test_shipped_gsm8k_keeps_its_prompt_format():
    prompts = load_prompts(TaskConfig(name="gsm8k", test_size=3), "test")
    assert len(prompts) == 3 and prompts[0].prompt_uid == "gsm8k/test/0"
    assert prompts[0].text.startswith("Question: ") and prompts[0].text.endswith("\nAnswer:")


def test_shipped_gsm8k_has_its_rows_licence_and_checksums():
    folder = REPO_ROOT / "data" / "gsm8k"
    assert "MIT License" in (folder / "LICENSE").read_text()
    listed = {line.split()[1] for line in (folder / "SHA256SUMS").read_text().splitlines()}
    assert listed == {"train.jsonl.gz", "test.jsonl.gz"}
    for split, rows in (("train", 7473), ("test", 1319)):
        path = REPO_ROOT / GSM8K_FILES[split]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"{digest}  {path.name}" in (folder / "SHA256SUMS").read_text()
        read = read_rows(path)
        assert len(read) == rows and all(set(r) == {"question", "answer"} for r in read)
        assert len(load_prompts(TaskConfig(name="gsm8k", test_size=rows), split)) == rows


def test_gzipped_jsonl_reads_like_plain_jsonl(tmp_path):
    plain = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    packed = tmp_path / "rows.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_rows(packed) == read_rows(plain) == ROWS
    cfg = TaskConfig(data=DataConfig(train=str(packed), test=str(plain), question_key="q", answer_key="a"))
    assert [p.prompt_uid for p in load_prompts(cfg, "train")] == ["rows/train/0", "rows/train/1", "rows/train/2"]


def test_a_checksum_mismatch_names_the_file(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    good = hashlib.sha256(path.read_bytes()).hexdigest()
    (tmp_path / "SHA256SUMS").write_text(f"{good}  train.jsonl\n{'0' * 64}  other.jsonl\n")
    assert read_rows(path) == ROWS  # listed and intact
    write_jsonl(path, ROWS[:2])  # changed after its checksum was written
    with pytest.raises(ValueError, match=rf"{path}: sha256 \w+ does not match {good}"):
        read_rows(path)
    unlisted = write_jsonl(tmp_path / "more.jsonl", ROWS)  # a file the sums do not name is not checked
    assert read_rows(unlisted) == ROWS


@pytest.mark.parametrize(
    "line, message",
    [
        ('["What is 2+3?", "5"]', r"row 1: a row must be a mapping of columns, got list"),
        ('{"a": "5"}', r"row 1: no column \['q'\]"),
        ('{"q": 7, "a": "5"}', r"row 1: question 'q' \(7\) must be a non-empty string"),
        ('{"q": "  ", "a": "5"}', r"row 1: question 'q' .* must be a non-empty string"),
        ('{"q": "Why?", "a": null}', r"row 1: answer 'a' \(None\) must be a non-empty string or a number"),
        ('{"q": "Why?", "a": [5]}', r"row 1: answer 'a' \(\[5\]\) must be"),
        ('{"q": "Why?", "a": true}', r"row 1: answer 'a' \(True\) must be"),
        ('{"q": "Why?", "a": "#### none"}', r"row 1: answer '#### none' has no number after '####'"),
        ('{"q": "Why?", "a": ', r"line 2 \(row 1\): not JSON"),
    ],
)
def test_a_bad_row_names_the_file_and_the_row(tmp_path, line, message):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    cfg = TaskConfig(name="gsm8k", data=DataConfig(train=str(path), test=str(path), question_key="q", answer_key="a"))
    with pytest.raises((ValueError, KeyError), match=re.escape(str(path)) + ".*" + message):
        load_prompts(cfg, "train")


def test_hf_sources_parse_name_and_config():
    assert parse_hf_source("hf://openai/gsm8k:main") == HFSource("openai/gsm8k", "main")
    assert parse_hf_source("hf://gsm8k") == HFSource("gsm8k", None)
    for bad in ("hf://", "hf://openai/gsm8k:", "hf://a/b/c", "hf://openai/", "hf://my data"):
        with pytest.raises(ValidationError, match="must look like|empty config"):
            DataConfig(train=bad)
    with pytest.raises(ValueError, match="must start with 'hf://'"):
        parse_hf_source("openai/gsm8k")


def test_hf_source_offline_fails_at_once_saying_how_to_get_the_data(monkeypatch):
    cfg = TaskConfig(name="gsm8k", data=DataConfig(train="hf://openai/gsm8k:main"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(
        ConnectionError, match=r"'hf://openai/gsm8k:main' needs the Hugging Face Hub.*HF_DATASETS_OFFLINE=1"
    ) as e:
        load_prompts(cfg, "test")  # the test split of the same dataset, by default
    assert 'load_dataset("openai/gsm8k", "main").save_to_disk("data/openai--gsm8k--main")' in str(e.value)
    assert "set task.data.train to it" in str(e.value)


def test_hf_source_without_network_fails_at_once(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on: the connect is refused, nothing leaves the host
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    cfg = TaskConfig(data=DataConfig(train="hf://openai/gsm8k:main", test="hf://openai/gsm8k:main"))
    with pytest.raises(ConnectionError, match=rf"no connection to http://127.0.0.1:{port}"):
        load_prompts(cfg, "train")


PATH_LEAVING_THE_REPO = re.compile(r"(^|[^.\w])\.\./|/work/|/shared/data")


def test_no_config_or_code_reads_outside_the_repository():
    scanned = [
        *(REPO_ROOT / "configs").rglob("*.yaml"),
        *(REPO_ROOT / "asyncrl").rglob("*.py"),
        *(REPO_ROOT / "tests").rglob("*.py"),
        *(REPO_ROOT / "bench").rglob("*.py"),
        *(REPO_ROOT / "scripts").rglob("*"),
        REPO_ROOT / "Makefile",
    ]
    this = Path(__file__).resolve()
    leaving = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in scanned
        if path.is_file() and path.resolve() != this
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if PATH_LEAVING_THE_REPO.search(line)
    ]
    assert leaving == []

    def strings(node):
        if isinstance(node, dict):
            yield from (s for value in node.values() for s in strings(value))
        elif isinstance(node, list):
            yield from (s for value in node for s in strings(value))
        elif isinstance(node, str):
            yield node

    for recipe in (REPO_ROOT / "configs").glob("*.yaml"):
        for value in strings(load_yaml(recipe)):
            if "/" in value and "://" not in value:
                assert (REPO_ROOT / value).resolve().is_relative_to(REPO_ROOT), f"{recipe.name}: {value}"
    for path in GSM8K_FILES.values():  # the task's own data is inside the checkout
        assert (REPO_ROOT / path).resolve().is_relative_to(REPO_ROOT) and (REPO_ROOT / path).is_file()


def test_answer_of():
    assert answer_of("#### 1,234") == "1234"
    assert answer_of(" Paris ") == "Paris"
    assert answer_of(7) == "7"
