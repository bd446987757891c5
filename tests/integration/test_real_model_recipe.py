"""A few steps of the real-model recipe (configs/grpo_smollm2_arithmetic.yaml): SmolLM2-135M-Instruct,
its chat template and BPE tokenizer, real vLLM and DeepSpeed, every setting the recipe turns on
(continuous generation with in-flight updates and partial rollouts, auto staleness, the
zero-variance filter, packing, a cosine schedule, the calibrated probe, sampled evaluation).
What it learns is measured by bench/real_model.py, not here: this checks that the whole path runs,
reconciles and serves the published weights."""

import json

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow  # a real model, vLLM, DeepSpeed: about two minutes on 2 cores
def test_the_real_model_recipe_trains_a_few_steps_and_serves_what_it_publishes(tmp_path, smollm2_dir):
    cfg = load_config(
        "configs/grpo_smollm2_arithmetic.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=real",
            f"model.path={smollm2_dir}",
            "learner.total_steps=2",
            "learner.batch_groups=2",
            "sampling.n=4",
            "sampling.max_tokens=32",
            "eval.num_prompts=8",
            "eval.max_new_tokens=32",
            "eval.every_versions=null",
        ],
    )
    summary = Controller(cfg).run()
    run = tmp_path / "real"
    assert summary["learner_steps"] == 2 and summary["reconciles"], summary
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
    evals = _lines(run / "evals.jsonl")
    assert [e["label"] for e in evals] == ["before", "after"]
    assert all(e["samples_k"] == 2 and 0 <= e["pass_at_k"] <= 1 and e["completed"] is not None for e in evals)
    probes = _lines(run / "probes.jsonl")  # every version published was checked, within the calibrated bound
    assert {p["version"] for p in probes} == {1, 2}
    assert all(p["noise"] is not None and p["mean_diff"] <= p["tol"] for p in probes), probes
    steps = _lines(run / "steps.jsonl")
    assert [s["lr"] for s in steps] == sorted(s["lr"] for s in steps) and steps[0]["lr"] < steps[1]["lr"]  # the warm-up
    samples = _lines(run / "samples.jsonl")
    assert samples and all(s["prompt"].startswith("<|im_start|>") for s in samples)  # the chat template
