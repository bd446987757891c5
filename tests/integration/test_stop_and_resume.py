"""Ctrl-C a running pipeline (simulated engines, every other process real): the ledger reports the
groups in flight at the stop as such, not as lost, and the resumed run trains each group once."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from asyncrl.cli import main
from asyncrl.observability.inspect_run import inspect_run

pytestmark = pytest.mark.slow  # two runs of real processes (~30 s)

SIMULATED = [
    "sampling.max_tokens=64",
    "run.num_generators=2",
    "run.console=quiet",
    "checkpoint.every_steps=5",
    "run.stall_timeout_s=120",
]


def test_ctrl_c_leaves_groups_in_flight_not_lost_and_a_resume_trains_each_once(tmp_path):
    run_dir = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "configs/bench_pipeline.yaml", f"run.root={tmp_path}"]
    cmd += ["run.name=stopped", "learner.total_steps=100000", *SIMULATED]
    # SIGINT as a terminal's Ctrl-C delivers it (a shell's background job would ignore it)
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    steps = run_dir / "steps.jsonl"
    deadline = time.monotonic() + 180
    while not (steps.exists() and steps.read_text().count("\n") >= 7):  # past the checkpoint at 5
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its seventh step"
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=90)
    gone, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:  # what this test started must not outlive it, even when it fails
        p.kill()
    assert proc.returncode == 130 and not alive
    assert err.rstrip().endswith(b"interrupted") and b"Traceback" not in err, err[-2000:]

    controller = [json.loads(line) for line in (run_dir / "ledger" / "controller.jsonl").read_text().splitlines()]
    assert controller[-1]["event"] == "stop" and controller[-1]["reason"] == "interrupted (Ctrl-C)"
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["stopped"] == "interrupted (Ctrl-C)" and summary["counters_reconcile"] is None
    assert summary["learner_steps"] >= 7 and 5 in summary["checkpoints"]
    assert ledger["in_flight_at_stop"] > 0, ledger  # the generators were sampling when it stopped
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and summary["reconciles"], ledger
    assert b"in flight at the stop" in err
    run = inspect_run(run_dir)["run"]
    assert run["status"] == "stopped" and not run["finished"] and run["lost"] == 0

    stopped_at = summary["learner_steps"]
    total = stopped_at + 5
    assert main(["train", "--resume", str(run_dir), f"learner.total_steps={total}"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert "stopped" not in summary and summary["learner_steps"] == total and summary["reconciles"], summary
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["in_flight_at_stop"] == 0, ledger
    assert ledger["restores"] == 1
    assert inspect_run(run_dir)["run"]["status"] == "done"
