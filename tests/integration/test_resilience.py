"""Kill components of a running pipeline (simulated engines, every other process real) and check
that supervision brings the run to its end with every group accounted for by id; then resume a
finished run from its checkpoint and train on, exactly once."""

import json
import os
import signal
import threading
import time

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.controller.process import Controller
from asyncrl.rundir import ledger_replay
from asyncrl.rundir.ledger import iter_lines, segments_by_source
from tests.integration.kills import kill_at_steps

pytestmark = pytest.mark.slow  # whole runs of real processes, killed and restarted (~80 s)

SIMULATED = [
    "sampling.max_tokens=64",
    "run.num_generators=2",
    "run.console=quiet",
    "checkpoint.every_steps=5",
    "supervision.backoff_initial_s=0.2",
    "run.stall_timeout_s=120",
]


def test_killed_generator_reward_worker_buffer_and_learner_lose_nothing(tmp_path, monkeypatch):
    # Ledger segments of 2 KB, compacted at every checkpoint up to half a second ago: the replay
    # must reconcile across rotations, compactions and the restore.
    monkeypatch.setattr(ledger_replay, "CUT_MARGIN_S", 0.5)
    overrides = [f"run.root={tmp_path}", "learner.total_steps=40", "checkpoint.ledger_segment_mb=0.002", *SIMULATED]
    cfg = load_config("configs/bench_pipeline.yaml", overrides)
    controller = Controller(cfg)
    killed: list[str] = []
    plan = [(4, "generator-1"), (9, "reward-0"), (14, "buffer"), (22, "learner")]
    threading.Thread(target=kill_at_steps, args=(controller, plan, killed), daemon=True).start()
    summary = controller.run()
    assert killed == [name for _, name in plan]
    assert [d["name"] for d in summary["deaths"]] == killed and summary["restores"] == 1
    assert summary["learner_steps"] == 40 and summary["reconciles"], summary
    ledger = summary["ledger"]
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, ledger
    assert ledger["restores"] == 1
    assert summary["checkpoints"][-1] == 40 and 20 in summary["checkpoints"]
    # Compaction removed every closed segment wholly before its last cut. A segment's index is
    # the next free one (the highest left, plus one), so once the old ones are gone a new segment
    # may be named ``dispatcher.1.jsonl`` again: the check is by the lines, not by the names.
    assert (controller.run_dir / "ledger" / ledger_replay.COMPACTED).exists()
    _state, cut = ledger_replay.load_compacted(controller.run_dir)
    assert cut > float("-inf")
    by_source = segments_by_source(controller.run_dir)
    restored_at = min(
        line["t"]
        for _index, path in by_source["controller"]
        for line in iter_lines(path, "controller")
        if line["event"] == "restore"
    )
    for source, segments in by_source.items():
        for index, path in segments:
            times = [line["t"] for line in iter_lines(path, source)]
            if index is not None:
                assert max(times) >= cut, f"{path.name}: wholly before the cut, yet not removed"
            if source == "dispatcher" and times:  # the open segment may be new, still empty
                assert min(times) >= restored_at, f"{path.name}: a line from before the restore is left"


def test_resume_continues_from_the_checkpoint_and_trains_each_group_once(tmp_path, capsys):
    overrides = [f"run.root={tmp_path}", "run.name=resumed", "learner.total_steps=10", *SIMULATED]
    assert main(["train", "configs/bench_pipeline.yaml", *overrides]) == 0
    run_dir = tmp_path / "resumed"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "v00000010"
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "learner.total_steps=20"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] == 20 and summary["reconciles"]
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
    assert summary["ledger"]["restores"] == 1
    versions = [json.loads(line)["version"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert versions == list(range(1, 21))  # the resumed run went on from version 10


def test_sigterm_stops_the_run_and_every_process_it_started(tmp_path):
    import subprocess
    import sys

    import psutil

    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "configs/bench_pipeline.yaml", f"run.root={tmp_path}"]
    cmd += ["learner.total_steps=100000", "run.name=term", *SIMULATED]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    steps = tmp_path / "term" / "steps.jsonl"
    deadline = time.monotonic() + 180
    while not (steps.exists() and steps.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its second step"
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 5  # buffer, dispatcher, reward worker, learner, generators
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    gone, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:  # what this test started must not outlive it, even when it fails
        p.kill()
    assert not alive, f"left running after SIGTERM: {[p.pid for p in alive]}"
