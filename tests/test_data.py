"""Prompts from JSONL, Parquet and saved Hugging Face datasets, keys, templates, chat templates."""

import json

import pytest
from pydantic import ValidationError

from asyncrl.data import DataConfig, answer_of, read_rows
from asyncrl.tasks import TaskConfig, load_prompts

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
    from asyncrl.tokenizer import build_char_tokenizer

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


def test_gsm8k_from_shared_data_keeps_its_prompt_format():
    prompts = load_prompts(TaskConfig(name="gsm8k", test_size=3), "test")
    assert prompts[0].text.startswith("Question: ") and prompts[0].text.endswith("\nAnswer:")


def test_answer_of():
    assert answer_of("#### 1,234") == "1234"
    assert answer_of(" Paris ") == "Paris"
    assert answer_of(7) == "7"
