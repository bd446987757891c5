"""``asyncrl generator --connect RUN_DIR`` joins a running (simulated) run, samples for it, and
leaves with the run's stop; the run's accounting includes it and Prometheus scrapes it; one
that dies is noticed and its prompts handed out again (both in one run)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import yaml

from asyncrl.config import load_config
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # a whole run of real processes (~30 s)


def join(run_dir, name: str, log_dir) -> subprocess.Popen:
    """``asyncrl generator --connect RUN_DIR --name NAME``, its output in ``log_dir/NAME.log``."""
    log = open(log_dir / f"{name}.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "asyncrl.cli", "generator", "--connect", str(run_dir), "--name", name]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def test_joined_generators_are_accounted_for_and_one_that_dies_is_noticed(tmp_path):
    """Two generators join a running run. One samples until the run's stop and leaves with it: the
    run's accounting, its metrics and the scrape config include it. The other is SIGKILLed while
    it holds prompts: its death is noticed within ``supervision.joined_timeout_s``, its prompts
    are handed out again, and nothing is lost or trained twice."""
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=join",
            "run.num_generators=1",
            "run.console=quiet",
            "learner.total_steps=60",
            "learner.batch_groups=4",
            "sampling.max_tokens=128",
            "simulation.generator.decode_step_s=0.01",  # slow enough that the run outlasts the joins
            "supervision.joined_timeout_s=5",
        ],
    )
    controller = Controller(cfg)
    result = {}
    run = threading.Thread(target=lambda: result.update(controller.run()))
    run.start()
    run_dir = tmp_path / "join"
    joined: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "steps.jsonl").exists():  # training is under way
            assert run.is_alive() and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        hot, doomed = (join(run_dir, name, tmp_path) for name in ("generator-hot", "generator-doomed"))
        joined += [hot, doomed]
        while "generator-doomed" not in controller.reports.joined:  # it is heard from: it samples
            assert run.is_alive() and time.monotonic() < deadline + 60, "the joined generator was never heard from"
            time.sleep(0.1)
        time.sleep(2.0)  # holding prompts of its batch
        doomed.kill()
        killed_at = time.monotonic()
        while not any(d.get("joined") for d in controller.supervisor.deaths):
            assert run.is_alive(), "the run ended before the death was noticed"
            assert time.monotonic() - killed_at < 5 + 2 + 30, "the death was not noticed within the timeout"
            time.sleep(0.1)
        run.join(300)
        assert not run.is_alive(), "the run did not finish"
        assert hot.wait(60) == 0, (tmp_path / "generator-hot.log").read_text()[-3000:]
    finally:
        for p in joined:
            if p.poll() is None:
                p.kill()
    summary = result
    assert summary["learner_steps"] == 60 and summary["reconciles"], summary
    assert [(d["name"], d.get("joined")) for d in summary["deaths"]] == [("generator-doomed", True)]
    ledger = summary["ledger"]
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, ledger
    prom = (run_dir / "metrics" / "generator-hot.prom").read_text()
    generated = [line for line in prom.splitlines() if line.startswith('asyncrl_samples_total{outcome="generated"}')]
    assert generated and float(generated[0].split()[-1]) > 0, "the joined generator sampled nothing"
    assert 'asyncrl_policy_version{component="generator-hot"}' in prom
    scrape = yaml.safe_load((run_dir / "prometheus.yml").read_text())
    assert "generator-hot" in {t["labels"]["component"] for t in scrape["scrape_configs"][0]["static_configs"]}
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 60
