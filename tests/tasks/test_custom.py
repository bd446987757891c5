"""A task of the user's: any name, rows from a file, every column carried to the rewards."""

import asyncio
import json

import numpy as np
import pytest
from pydantic import ValidationError

from asyncrl.config import RunConfig
from asyncrl.generators.completion import Completion
from asyncrl.generators.groups import build_groups
from asyncrl.rewards.function import PythonReward, PythonRewardConfig
from asyncrl.tasks.answers import score_answer
from asyncrl.tasks.prompts import TaskConfig, load_prompts
from asyncrl.tasks.sources import DataConfig, row_columns
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import GroupMessage, PromptRow, Prompts

ROWS = [
    {"problem": "Sam has 3 apples and gets 4 more. How many?", "solution": "7", "a": 3, "b": 4, "op": "+"},
    {"problem": "What is 9 minus 2?", "solution": "7", "a": 9, "b": 2, "op": "-"},
    {"problem": "Spell cat backwards.", "solution": "tac", "a": 0, "b": 0, "op": "rev", "tags": ["x"]},
]


def words_task(tmp_path, **data) -> TaskConfig:
    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    keys = {"train": str(path), "test": str(path), "question_key": "problem", "answer_key": "solution"}
    return TaskConfig(
        name="words",
        data=DataConfig(**{**keys, "prompt_template": "Q: {question}\nA:", **data}),
        metadata={"unit": "apples"},
    )


def test_any_name_with_data_is_a_task_whose_rows_keep_every_column(tmp_path):
    prompts = load_prompts(words_task(tmp_path), "train")
    assert [p.task for p in prompts] == ["words"] * 3
    first = prompts[0]
    assert first.text == f"Q: {ROWS[0]['problem']}\nA:" and first.answer == "7"
    assert first.prompt_uid == "words/train/0" and first.columns == ROWS[0]
    assert prompts[2].columns["tags"] == ["x"]


def test_the_answer_is_optional_and_the_columns_can_be_chosen(tmp_path):
    prompts = load_prompts(words_task(tmp_path, answer_key=None, row_keys=["a", "b"]), "train")
    assert [p.answer for p in prompts] == ["", "", ""]
    assert prompts[1].columns == {"a": 9, "b": 2}


def test_a_name_that_is_not_built_in_needs_data_and_a_name_must_be_plain():
    with pytest.raises(ValidationError, match=r"task.name \('words'\) is not built in .*set task.data.train"):
        TaskConfig(name="words")
    with pytest.raises(ValidationError, match=r"task name \('my task'\) must be letters"):
        TaskConfig(name="my task", data=DataConfig(train="x.jsonl"))


def test_a_column_that_is_not_a_json_value_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"f.jsonl row 4: column 'img' holds a bytes.*row_keys"):
        row_columns({"q": "x", "img": b"\x00"}, "f.jsonl", 4, None)
    assert row_columns({"q": "x", "img": b"\x00"}, "f.jsonl", 4, ["q"]) == {"q": "x"}


def test_exact_match_of_a_users_task_compares_numbers_as_numbers_else_text():
    assert score_answer("words", "so the answer is 1,000", "1000") == 1.0
    assert score_answer("words", " tac ", "tac") == 1.0 and score_answer("words", "cat", "tac") == 0.0
    with pytest.raises(ValueError, match="no reference answer"):
        score_answer("words", "7", "")


def test_exact_match_on_a_task_without_answers_is_refused_when_the_config_is_read(tmp_path):
    task = words_task(tmp_path, answer_key=None).model_dump()
    with pytest.raises(ValidationError, match=r"task 'words' has no reference answer .* \['exact_match'\]"):
        RunConfig(task=task)
    rewards = {"rewards": [{"kind": "python", "options": {"function": "tests.rewards.user_rewards:length"}}]}
    assert RunConfig(task=task, reward=rewards).task.name == "words"


def test_the_rows_columns_travel_from_the_dispatcher_to_a_python_reward(tmp_path):
    """Prompt -> PromptRow (wire) -> the generator's group -> GroupMessage (wire) -> the reward."""
    prompt = load_prompts(words_task(tmp_path), "train")[1]
    row = PromptRow(
        group_id="g1", prompt_uid=prompt.prompt_uid, text=prompt.text, answer=prompt.answer, task=prompt.task
    )
    row["columns"] = prompt.columns
    _, reply = decode(encode(Prompts(prompts=[row])))
    completion = Completion(
        response_ids=np.array([5, 6], np.int32),
        logprobs=np.array([-0.1, -0.2], np.float32),
        text="7",
        finish_reason="stop",
        prompt_ids=np.array([1, 2, 3], np.int32),
        version_segments=None,
    )
    (group,) = build_groups(reply.prompts, [[completion, completion]], version=0, generator="g", rollout_s=0.1)
    _, message = decode(encode(GroupMessage(group=group)))
    received = message.group
    assert received.columns == ROWS[1] and received.task == "words"
    reward = PythonReward(
        "py", PythonRewardConfig(function="tests.rewards.user_rewards:from_row"), {"words": {"scale": 10}}
    )
    try:
        results = asyncio.run(reward.score(received))
    finally:
        asyncio.run(reward.close())
    assert list(results) == [91.0, 91.0]  # a=9 times scale 10, +1 for the task's name


def test_a_row_without_columns_still_decodes():
    row = PromptRow(group_id="g1", prompt_uid="addition/01+02", text="01+02=", answer="3", task="addition")
    _, reply = decode(encode(Prompts(prompts=[row])))
    assert "columns" not in reply.prompts[0]
