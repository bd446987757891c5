"""Held-out evaluation by the generators' vLLM engines, through the real pipeline: before RL on
the served initial weights, during training without pausing it, after the final weights are
served; scored like Hugging Face greedy decoding of the same weights, and never a sample."""

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.config import load_config
from asyncrl.controller.preparation import evaluate
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # vLLM generators and a DeepSpeed learner in real processes


def test_generators_evaluate_before_during_and_after_training(tmp_path):
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=ev",
            "run.console=quiet",
            "learner.total_steps=4",
            "learner.broadcast_every=2",
            "learner.batch_groups=4",
            "generator.prompts_per_batch=4",
            "sampling.n=4",
            "buffer.max_staleness=2",
            "sft.steps=20",
            "eval.num_prompts=40",
            "eval.chunk_prompts=8",
            "eval.every_versions=2",
            "eval.samples_k=2",
        ],
    )
    summary = Controller(cfg).run()
    run_dir = tmp_path / "ev"

    evals = summary["evals"]
    assert [e["label"] for e in evals] == ["before", "v2", "after"]
    assert all(e["failed"] is None and e["num_prompts"] == 40 for e in evals)
    # before RL every generator serves the initial weights; after, the final ones
    assert evals[0]["versions"] == [0, 0] and evals[-1]["versions"] == [4, 4]
    assert evals[1]["version"] == 2 and 2 <= evals[1]["versions"][0] <= evals[1]["versions"][1] <= 4
    assert summary["eval_before"] == evals[0]["exact_match"] and summary["eval_after"] == evals[-1]["exact_match"]
    assert sum(evals[0]["generators"].values()) == 40  # both generators share the work
    # sampled answers beside greedy, and completed correctness, from the real engines
    for e in evals:
        assert e["samples_k"] == 2 and 0 <= e["mean_at_k"] <= e["pass_at_k"] <= 1, e
        assert 0 <= e["completed"] <= 1 and 0 <= e["sampled_completed"] <= 1, e
        assert e["rewards"] == {"addition": "exact_match"}
    # The same greedy decoding of the same weights as Hugging Face on the CPU (float32 both):
    # equal up to a near tie flipped by kernels that sum in another order.
    for record, model in ((evals[0], run_dir / "model" / "warm"), (evals[-1], run_dir / "final")):
        assert abs(record["exact_match"] - evaluate(cfg, Path(model))) <= 2 / 40, record

    # Evaluation is not training: every sample still reconciles, the trained count is exact,
    # the evaluation prompts are counted apart.
    assert summary["reconciles"] and all(v == 0 for v in summary["unaccounted_by_link"].values()), summary
    assert summary["trained"] == 4 * 4 * 4
    assert summary["eval_prompts_answered"] == 3 * 40
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0

    # Written where a user looks: evals.jsonl, TensorBoard, Prometheus.
    lines = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [line["label"] for line in lines] == ["before", "v2", "after"]
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    points = {e.step: e.value for e in tb.Scalars("eval/exact_match")}
    assert set(points) == {0, 2, 4} and points[2] == pytest.approx(evals[1]["exact_match"])
    controller = (run_dir / "metrics" / "controller.prom").read_text()
    assert f"asyncrl_eval_exact_match {float(evals[-1]['exact_match'])}" in controller
    assert "asyncrl_eval_version 4.0" in controller
    generators = [(run_dir / "metrics" / f"generator-{i}.prom").read_text() for i in range(2)]
    answered = sum(
        float(line.split()[1])
        for text in generators
        for line in text.splitlines()
        if line.startswith("asyncrl_eval_prompts_total")
    )
    assert answered == 3 * 40
