"""Held-out evaluation through the real controller and generator processes on simulated engines:
greedy and sampled answers, scored by each source's own rewards (exact match, a python reward),
completed correctness, and an extra evaluation set, in evals.jsonl, summary.json and TensorBoard."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.config import load_config
from asyncrl.controller.process import Controller


@pytest.mark.slow  # real processes
def test_a_run_reports_sampled_and_completed_figures_per_source_and_set(tmp_path):
    rows = [
        # the answer column in words: exact match would never call "0" right; the python reward reads a, b, op
        {"question": f"What is {a} plus {b}?", "answer": f"the sum of {a} and {b}", "a": a, "b": b, "op": "+"}
        for a in range(10)
        for b in range(4)
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
            "task.name=mix",
            "task.test_size=10",
            f"task.sources=[{{name: words, data: {{train: {data}, test: {data}}}}}, {{name: addition}}]",
            f"reward.by_task={{words: {json.dumps(reward)}}}",
            "simulation.evaluate=true",
            "simulation.generator.accuracy=0.5",
            "eval.num_prompts=20",
            "eval.chunk_prompts=8",
            "eval.max_new_tokens=128",  # the simulated greedy answer (64 tokens) ends
            "eval.samples_k=4",
            "eval.every_versions=2",
            # the round before RL blocks: the learner cannot reach its last step before v2 is due
            "eval.overlap_before=false",
            f"eval.sets=[{{name: more_words, task: words, data: {{test: {data}}}, num_prompts: 6}}]",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 4 and summary["reconciles"], summary
    run_dir = tmp_path / "bench"
    lines = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["label"] for e in lines] == ["before", "v2", "after"] and lines == summary["evals"]
    for e in lines:
        assert e["failed"] is None and e["num_prompts"] == 20, e
        assert e["rewards"] == {"words": "words_reward", "addition": "exact_match"}
        assert e["samples_k"] == 4 and set(e["pass_at"]) == {"1", "2", "4"}
        for key in ("exact_match", "completed", "mean_at_k", "pass_at_k", "sampled_completed"):
            assert 0.0 <= e[key] <= 1.0, (key, e)
        assert e["mean_at_k"] <= e["pass_at_k"]
        # The simulated engine answers addition right greedily (accuracy 0.5) and "0" to a word
        # problem: the python reward calls that right for "0 plus 0" only, 1 of the 10 held out.
        assert e["by_task"]["addition"]["exact_match"] == 1.0 and e["by_task"]["words"]["exact_match"] == 0.1
        assert set(e["sets"]) == {"test", "more_words"} and e["sets"]["more_words"]["num_prompts"] == 6
    assert summary["eval_before"] == lines[0]["exact_match"] and summary["eval_after"] == lines[-1]["exact_match"]
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    tags = set(tb.Tags()["scalars"])
    assert {"eval/mean_at_k", "eval/pass_at_k", "eval/completed_accuracy", "eval/pass_at_k/words"} <= tags, tags
    assert {e.step for e in tb.Scalars("eval/pass_at_k")} == {0, 2, 4}
