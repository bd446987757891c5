"""Prompts of both tasks, their splits, their length in tokens, and the exact-match score."""

import json
import logging

import pytest

from asyncrl.tasks.answers import extract_gsm8k_answer, score_answer
from asyncrl.tasks.prompts import TaskConfig, load_prompts, load_run_prompts


def test_addition_splits_partition_all_pairs():
    cfg = TaskConfig()
    train, test = load_prompts(cfg, "train"), load_prompts(cfg, "test")
    assert len(test) == 500 and len(train) == 9500
    uids = {p.prompt_uid for p in train} | {p.prompt_uid for p in test}
    assert len(uids) == 10_000


def test_addition_prompt_format():
    prompts = {p.prompt_uid: p for p in load_prompts(TaskConfig(test_size=1), "train")}
    prompts.update({p.prompt_uid: p for p in load_prompts(TaskConfig(test_size=1), "test")})
    prompt = prompts["addition/07+45"]
    assert (prompt.text, prompt.answer, prompt.task) == ("07+45=", "52", "addition")
    assert prompts["addition/99+99"].answer == "198" and prompts["addition/00+00"].answer == "0"


def test_addition_test_split_depends_on_seed_only():
    test = lambda seed: [p.prompt_uid for p in load_prompts(TaskConfig(seed=seed), "test")]  # noqa: E731
    assert test(0) == test(0)
    assert test(0) != test(1)


def test_gsm8k_prompts():
    cfg = TaskConfig(name="gsm8k", test_size=20)
    test = load_prompts(cfg, "test")
    assert len(test) == 20
    first = test[0]
    assert first.prompt_uid == "gsm8k/test/0" and first.task == "gsm8k"
    assert first.text.startswith("Question: ") and first.text.endswith("\nAnswer:")
    assert first.answer == "18"
    assert all(p.answer.lstrip("-").isdigit() for p in test)


def test_max_prompt_chars_drops_long_prompts():
    prompts = load_prompts(TaskConfig(name="gsm8k", max_prompt_chars=200), "train")
    assert prompts and all(len(p.text) <= 200 for p in prompts)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"test_size": 0}, "test_size (0)"),
        ({"test_size": 10_000}, "test_size (10000)"),
        ({"max_prompt_chars": 0}, "max_prompt_chars (0)"),
    ],
)
def test_config_rejects_bad_values(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TaskConfig(**fields)


def test_config_rejects_unknown_keys_and_tasks():
    with pytest.raises(ValueError):
        TaskConfig(nmae="addition")
    with pytest.raises(ValueError):
        TaskConfig(name="mnist")


def test_missing_data_file_names_the_path():
    with pytest.raises(FileNotFoundError, match="no/such/train.jsonl"):
        load_prompts(TaskConfig(name="gsm8k", data={"train": "no/such/train.jsonl", "test": "t.jsonl"}), "train")


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("so 9 * 2 = 18\n#### 18") == "18"
    assert extract_gsm8k_answer("#### 1 #### 1,000 dollars") == "1000"
    assert extract_gsm8k_answer("#### -3.5") == "-3.5"
    assert extract_gsm8k_answer("the answer is 18") is None
    assert extract_gsm8k_answer("#### none") is None


def test_score_addition():
    assert score_answer("addition", " 52\n", "52") == 1.0
    assert score_answer("addition", "5 2", "52") == 0.0
    assert score_answer("addition", "520", "52") == 0.0
    assert score_answer("addition", "", "52") == 0.0


def test_score_gsm8k():
    assert score_answer("gsm8k", "3 + 4 = 7 so #### 1,000", "1000") == 1.0
    assert score_answer("gsm8k", "She pays $3.0 in total.", "3") == 1.0
    assert score_answer("gsm8k", "#### 18 then 20", "18") == 1.0  # the #### number wins over the last one
    assert score_answer("gsm8k", "it is 17", "18") == 0.0
    assert score_answer("gsm8k", "no idea", "18") == 0.0
    assert score_answer("gsm8k", "#### -5", "-5") == 1.0


def test_a_users_task_without_an_answer_has_no_exact_match():
    with pytest.raises(ValueError, match="'chess'"):
        score_answer("chess", "1", "")


def test_batch_accuracy_counts_correctness_rewards_only():
    from types import SimpleNamespace as NS

    from asyncrl.tasks.answers import batch_accuracy

    group = lambda *parts: NS(samples=[NS(reward_parts=p) for p in parts])  # noqa: E731
    groups = [group({"exact_match": 1.0, "format": 0.5}, {"exact_match": 0.0}), group({"math_verify": 1.0}, {})]
    assert batch_accuracy(groups) == 2 / 3  # the sample no correctness reward scored is left out
    assert batch_accuracy([group({"judge": 0.9})]) is None


def write_rows(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
    return path


def run_config(tmp_path, max_model_len, max_tokens, **task):
    from asyncrl.config import RunConfig

    rows = write_rows(tmp_path / "rows.jsonl", ["short one?", "x" * 30 + " How many?", "y" * 25])
    task = {"data": {"train": str(rows), "test": str(rows), "prompt_template": "Q: {question}\nA:"}, **task}
    return RunConfig.model_validate(
        {"task": task, "engine": {"max_model_len": max_model_len}, "sampling": {"max_tokens": max_tokens}}
    )


def test_long_prompts_are_dropped_by_tokens_and_logged_once(tmp_path, caplog):
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    build_char_tokenizer(tmp_path / "model")  # one token per character, nothing added
    assert TaskConfig().long_prompts == "drop"
    cfg = run_config(tmp_path, max_model_len=40, max_tokens=10)  # room for 30 prompt tokens
    with caplog.at_level(logging.WARNING, logger="asyncrl.tasks.prompt_length"):
        prompts = load_run_prompts(cfg, "train", tmp_path / "model")
    assert [p.text for p in prompts] == ["Q: short one?\nA:"]
    (record,) = caplog.records  # one line for the split, not one per row
    assert "train: dropped 2 of 3 prompts longer than 30 tokens (task.long_prompts: drop)" in record.message
    assert record.message.endswith("rows/train/1, rows/train/2")
    # Without a tokenizer in the model directory (a simulated run) nothing is measured.
    assert len(load_run_prompts(cfg, "train", tmp_path / "no-model")) == 3


def test_long_prompts_truncated_keep_the_end_of_the_question(tmp_path, caplog):
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    build_char_tokenizer(tmp_path / "model")
    cfg = run_config(tmp_path, max_model_len=40, max_tokens=10, long_prompts="truncate")
    with caplog.at_level(logging.WARNING, logger="asyncrl.tasks.prompt_length"):
        prompts = load_run_prompts(cfg, "test", tmp_path / "model")
    assert [p.text for p in prompts] == [
        "Q: short one?\nA:",
        "Q: " + "x" * 14 + " How many?\nA:",  # 30 tokens: the question's end and the template kept
        "Q: " + "y" * 24 + "\nA:",
    ]
    assert [p.answer for p in prompts] == ["1"] * 3
    (record,) = caplog.records
    assert "test: truncated (question cut from its start) 2 of 3 prompts longer than 30 tokens" in record.message


def test_a_template_longer_than_the_room_drops_even_when_truncating(tmp_path):
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    build_char_tokenizer(tmp_path / "model")
    cfg = run_config(tmp_path, max_model_len=15, max_tokens=10, long_prompts="truncate")  # 5 < the template's 6
    assert load_run_prompts(cfg, "train", tmp_path / "model") == []
    with pytest.raises(ValueError, match=r"engine.max_model_len \(40\) must exceed sampling.max_tokens \(40\)"):
        load_run_prompts(run_config(tmp_path, max_model_len=40, max_tokens=40), "train", tmp_path / "model")
    with pytest.raises(ValueError, match="long_prompts"):
        TaskConfig(long_prompts="cut")
