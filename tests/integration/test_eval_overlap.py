"""The held-out round before RL runs beside the first learner steps (``eval.overlap_before``) and
still scores the starting weights: the generators hold version 0 until the controller releases it."""

import json

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller


@pytest.mark.slow  # real processes
def test_the_round_before_rl_runs_beside_training_on_the_starting_weights(tmp_path):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.num_generators=1",
            "learner.total_steps=6",
            "learner.batch_groups=4",
            "buffer.max_staleness=2",
            "sampling.n=4",
            "sampling.max_tokens=32",
            "task.test_size=16",
            "simulation.evaluate=true",
            "eval.num_prompts=16",
            # one prompt a request, one request between two training batches: the round spans many
            # batches, enough for the learner's first steps, which it may take on version 0's samples
            "eval.chunk_prompts=1",
            "eval.max_new_tokens=128",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 6 and summary["reconciles"], summary
    run_dir = tmp_path / "bench"
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    before = evals[0]
    assert before["label"] == "before" and before["failed"] is None
    # the learner stepped (and published) while the round ran, yet only version 0 answered it
    assert steps[0]["t"] < before["wall_s"], (steps[0], before)
    assert before["versions"] == [0, 0], before
    assert "eval_before" not in summary["phases_s"]  # nothing waited for it
    assert summary["eval_before"] == before["exact_match"]
    assert json.loads((run_dir / "eval_before.json").read_text()) == before["exact_match"]
    log = (run_dir / "logs" / "generator-0.log").read_text()
    assert "serving the starting weights until the round before RL is answered" in log
    assert "applying publications again" in log
