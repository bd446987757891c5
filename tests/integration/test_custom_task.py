"""A run of a user's task mixed with a built-in one: rows from a JSONL file, a python reward for
the user's source (reward.by_task), exact match for the other, simulated engines, a few steps."""

import json

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller


@pytest.mark.slow  # real processes
def test_a_mix_with_a_python_reward_trains_and_scores_each_source_with_its_rewards(tmp_path):
    rows = [
        {"question": f"What is {a} plus {b}?", "answer": str(a + b), "a": a, "b": b, "op": "+"}
        for a in range(20)
        for b in range(5)
    ]
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = [
        {"kind": "python", "name": "words_reward", "options": {"function": "configs/rewards/word_arithmetic.py:reward"}}
    ]
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.num_generators=1",
            "learner.total_steps=4",
            "learner.batch_groups=4",
            "sampling.n=4",
            "sampling.max_tokens=32",
            "logging.samples_per_step=4",
            "task.name=mix",
            f"task.sources=[{{name: words, weight: 3, data: {{train: {data}, test: {data}}}}}, {{name: addition}}]",
            f"reward.by_task={{words: {json.dumps(reward)}}}",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 4 and summary["reconciles"], summary
    samples = [json.loads(line) for line in (tmp_path / "bench" / "samples.jsonl").read_text().splitlines()]
    parts = {s["task"]: set(s["reward_parts"]) for s in samples}
    assert parts.get("words") == {"words_reward"}, parts
    assert {s["task"] for s in samples} <= {"words", "addition"}
