"""The demo learns: async GRPO from the SFT warm start raises held-out exact match by >= 0.10.

The recipe as ``make demo`` runs it (only the run directory and the console differ), so the test
fails when a change stops the project's main job from learning; how ``eval_before`` and
``eval_after`` are scored is the controller's business, not this test's.

Two learner ranks are not run here: that they train exactly as one rank on the whole batch is
``tests/learner/test_ranks.py`` (every loss, at each ZeRO stage), and that whole runs of two ranks
checkpoint, resume, survive a killed rank and account for every group is
``tests/integration/test_learner_ranks.py``; a second demo would prove nothing more.
"""

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # a whole training run


def test_demo_recipe_gains_ten_points_of_exact_match(tmp_path):
    overrides = [f"run.root={tmp_path}", "run.name=demo", "run.console=quiet"]
    cfg = load_config("configs/demo.yaml", overrides)
    summary = Controller(cfg).run()

    assert summary["learner_steps"] == cfg.learner.total_steps
    assert summary["reconciles"], summary
    before, after = summary["eval_before"], summary["eval_after"]
    assert 0 <= before <= 1 and 0 <= after <= 1
    assert after - before >= 0.10, f"held-out exact match {before:.3f} -> {after:.3f}: gained less than 0.10"
