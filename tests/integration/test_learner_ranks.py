"""A learner of two DeepSpeed ranks in whole runs: it checkpoints per rank, resumes as a group
and trains every group once; a killed rank takes the group back to its checkpoint and nothing is
lost; a rank stuck in a collective is named, and the group restored. The generators are
simulated (random tokens from the tiny model's vocabulary), every other process is real.
"""

import json
import os
import signal
import threading

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.controller.process import Controller
from asyncrl.models.tiny import CHAR_VOCAB_SIZE
from tests.integration.kills import kill_at_steps
from tests.waits import wait_until

pytestmark = pytest.mark.slow  # whole runs of two DeepSpeed ranks (~30 s each)

TWO_RANKS = [
    "learner.ranks=2",
    "learner.batch_groups=4",
    "model.warm_start=false",
    f"simulation.generator.vocab_size={CHAR_VOCAB_SIZE}",
    "run.num_generators=1",
    "eval.before=false",
    "eval.after=false",
    "run.console=quiet",
    "checkpoint.every_steps=5",
    "supervision.backoff_initial_s=0.2",
]


def test_two_ranks_at_zero3_resume_as_a_group_and_train_each_group_once(tmp_path, capsys):
    overrides = [f"run.root={tmp_path}", "run.name=ranks", "learner.total_steps=10", "learner.trainer.zero_stage=3"]
    assert main(["train", "configs/demo.yaml", *TWO_RANKS, *overrides]) == 0
    run_dir = tmp_path / "ranks"
    policy = run_dir / "checkpoints" / "v00000010" / "learner" / "policy"
    assert sorted(p.name for p in policy.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]  # ZeRO-3 partitions: each rank saved its own
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "learner.total_steps=20"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] == 20 and summary["reconciles"], summary
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0, summary["ledger"]
    assert summary["ledger"]["restores"] == 1
    versions = [json.loads(line)["version"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert versions == list(range(1, 21))

    # The multi-rank checkpoint exports to the same weights as the final model both ranks saved.
    from safetensors.torch import load_file

    assert main(["export", str(run_dir), "--step", "20", str(tmp_path / "exported")]) == 0
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    final = load_file(run_dir / "final" / "model.safetensors")
    assert sorted(exported) == sorted(final)
    for name, tensor in final.items():
        assert (exported[name] - tensor).abs().max().item() < 1e-6, name


def test_killed_learner_rank_restores_the_group_and_loses_nothing(tmp_path):
    cfg = load_config("configs/demo.yaml", [f"run.root={tmp_path}", "learner.total_steps=15", *TWO_RANKS])
    controller = Controller(cfg)
    killed: list[str] = []
    threading.Thread(target=kill_at_steps, args=(controller, [(7, "learner-1")], killed), daemon=True).start()
    summary = controller.run()
    assert killed == ["learner-1"]
    deaths = [d["name"] for d in summary["deaths"]]
    # rank 0 may die too, of the collective rank 1 left: one restore either way
    assert deaths[0] == "learner-1" and set(deaths) <= {"learner-1", "learner"} and summary["restores"] == 1
    assert summary["learner_steps"] == 15 and summary["reconciles"], summary
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0, summary["ledger"]


def test_a_rank_stuck_outside_the_collectives_is_named_and_the_group_restored(tmp_path):
    """SIGSTOP rank 1: rank 0 waits in its next collective until the timeout, then fails naming
    the collective and where each rank last was; supervision restores the group (the stopped
    rank is killed with the rest)."""
    overrides = ["learner.total_steps=12", "learner.trainer.collective_timeout_s=10"]
    cfg = load_config("configs/demo.yaml", [f"run.root={tmp_path}", *TWO_RANKS, *overrides])
    controller = Controller(cfg)
    stopped: list[int] = []

    def stop_rank_1():
        wait_until(lambda: controller.progress.steps_seen >= 6, "the learner's step 6", timeout=600, interval=0.05)
        pid = controller.fleet.pid("learner-1")
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    threading.Thread(target=stop_rank_1, daemon=True).start()
    summary = controller.run()
    assert stopped and summary["restores"] == 1
    assert summary["learner_steps"] == 12 and summary["reconciles"], summary
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0, summary["ledger"]
    log = (tmp_path / cfg.run.name / "logs" / "learner.log").read_text()
    assert "collective" in log and "rank 1: " in log, log[-2000:]
