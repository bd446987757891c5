"""Continuous generation in a whole run (real control plane, simulated engines): ReMax's greedy
baseline rides with each group to the learner, and the batch barrier stays selectable."""

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # whole runs of real processes


@pytest.mark.parametrize("mode", ["continuous", "batch"])
def test_remax_trains_on_greedy_baselines_in_either_mode(tmp_path, mode):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.num_generators=2",
            "learner.total_steps=5",
            "sampling.max_tokens=32",
            f"generator.mode={mode}",
            "generator.greedy_baseline=true",
            "algorithm.adv_estimator=remax",
        ],
    )
    assert cfg.weights.apply_mode == ("in_flight" if mode == "continuous" else "between_requests")
    summary = Controller(cfg).run()
    # The learner refuses a ReMax batch with a group missing its greedy reward: 5 steps mean every
    # trained group carried one, scored from the greedy answer its generator sent along.
    assert summary["learner_steps"] == 5 and summary["reconciles"], summary
