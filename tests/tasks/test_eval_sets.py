"""Evaluation sets: the task's own split first, then each extra set under its name, read with the
task's keys and template, and reported apart."""

import json

import pytest
from pydantic import ValidationError

from asyncrl.config import RunConfig
from asyncrl.tasks.eval_round import EvalRound
from asyncrl.tasks.eval_sets import load_eval_prompts
from asyncrl.tasks.heldout import EvalConfig
from asyncrl.wire.messages import EvalResult


def test_extra_sets_follow_the_task_split_and_take_its_template(tmp_path):
    hard = tmp_path / "hard.jsonl"
    hard.write_text("".join(json.dumps({"question": f"{a}*{a}?", "answer": f"#### {a * a}"}) + "\n" for a in range(5)))
    cfg = RunConfig(
        task={"name": "gsm8k", "test_size": 3},
        eval={"num_prompts": 3, "sets": [{"name": "hard", "data": {"test": str(hard)}, "num_prompts": 4}]},
    )
    prompts, sets = load_eval_prompts(cfg, None)
    assert sets == ["test"] * 3 + ["hard"] * 4
    extra = prompts[3:]
    assert extra[0].text == "Question: 0*0?\nAnswer:" and extra[2].answer == "4"  # gsm8k's template and answers
    assert {p.task for p in prompts} == {"gsm8k"} and extra[0].prompt_uid.startswith("hard:")


def test_sets_must_be_named_apart_and_belong_to_a_task_of_the_run(tmp_path):
    one = {"name": "x", "data": {"test": "a.jsonl"}}
    with pytest.raises(ValidationError, match=r"eval.sets names \(\['x', 'x'\]\) must be distinct"):
        RunConfig(eval={"sets": [one, one]})
    with pytest.raises(ValidationError, match=r"task \('chess'\) must be a task of this run"):
        RunConfig(eval={"sets": [{**one, "task": "chess"}]})
    with pytest.raises(ValidationError, match=r"name \('test'\) is the task's own held-out split's"):
        RunConfig(eval={"sets": [{**one, "name": "test"}]})
    with pytest.raises(ValidationError, match=r"eval.samples_k \(4\) and eval.sets \(0\) need eval.engine: generators"):
        RunConfig(eval={"engine": "hf", "samples_k": 4})


def test_each_set_is_reported_under_its_name_with_sampled_figures():
    from asyncrl.tasks.prompts import Prompt

    prompts = [Prompt(str(i), f"{i}+1=", str(i + 1), "addition") for i in range(4)]
    r = EvalRound("v2", 2, prompts, EvalConfig(chunk_prompts=4, samples_k=2), sets=["test", "test", "extra", "extra"])
    assert len(r.request(0).seeds) == 4 and r.request(0).seeds == EvalRound("v4", 4, prompts, r.cfg).request(0).seeds
    body = EvalResult(
        round="v2",
        chunk=0,
        version=2,
        generator="g",
        texts=["1", "x", "3", "x"],
        seconds=0.1,
        queued_s=0,
        finish_reasons=["stop", "length", "stop", "stop"],
        samples=[["1", "1"], ["x", "x"], ["3", "x"], ["x", "x"]],
        sample_finish_reasons=[["stop", "stop"]] * 4,
    )
    r.answer(body)
    r.score(0, [[1.0 if t == str(i + 1) else 0.0 for t, _ in a] for i, a in enumerate(r.answers(0))])
    record = r.record()
    assert record["num_prompts"] == 2 and record["exact_match"] == 0.5 and record["completed"] == 0.5
    assert record["completed_accuracy"] == 1.0 and record["pass_at_k"] == 0.5 and record["mean_at_k"] == 0.5
    assert record["sets"]["extra"]["exact_match"] == 0.5 and record["sets"]["extra"]["mean_at_k"] == 0.25
    assert record["sets"]["extra"]["pass_at"] == {"1": 0.25, "2": 0.5}
