"""The demo learns: async GRPO from the SFT warm start raises held-out exact match by >= 0.10.

The recipe as ``make demo`` runs it (only the run directory and the console differ), with one
learner rank and with two (``make demo ARGS=learner.ranks=2``), so the test fails when a change stops the project's main job from learning; how ``eval_before`` and
``eval_after`` are scored is the controller's business, not this test's.
"""

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # a whole training run


@pytest.mark.parametrize("ranks", [1, 2])
def test_demo_recipe_gains_ten_points_of_exact_match(tmp_path, ranks):
    overrides = [f"run.root={tmp_path}", "run.name=demo", "run.console=quiet", f"learner.ranks={ranks}"]
    cfg = load_config("configs/demo.yaml", overrides)
    summary = Controller(cfg).run()

    assert summary["learner_steps"] == cfg.learner.total_steps
    assert summary["reconciles"], summary
    before, after = summary["eval_before"], summary["eval_after"]
    assert 0 <= before <= 1 and 0 <= after <= 1
    assert after - before >= 0.10, f"held-out exact match {before:.3f} -> {after:.3f}: gained less than 0.10"
