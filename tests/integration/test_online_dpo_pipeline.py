"""Online DPO through the whole control plane with simulated engines and learner: every process
reads the run's resolved config (``config.yaml``, every key spelt out) with ``algorithm.objective:
online_dpo``, and the run trains its steps and reconciles. The real step is
``tests/learner/trainer/test_online_dpo_step.py``'s; the recipe that learns is
``configs/online_dpo_addition.yaml`` (``bench/learn.py``)."""

import pytest
import yaml

from asyncrl.config import load_config
from asyncrl.controller.process import Controller


@pytest.mark.slow  # real processes
def test_a_simulated_online_dpo_run_loads_its_config_everywhere_and_reconciles(tmp_path):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "learner.total_steps=4",
            "sampling.max_tokens=32",
            "buffer.max_staleness=2",
            "algorithm.objective=online_dpo",
            "algorithm.dpo.beta=0.2",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 4 and summary["reconciles"], summary
    assert not summary.get("deaths"), summary["deaths"]
    written = yaml.safe_load((tmp_path / cfg.run.name / "config.yaml").read_text())
    assert written["algorithm"]["objective"] == "online_dpo" and written["algorithm"]["dpo"]["beta"] == 0.2
