"""``asyncrl generator --connect RUN_DIR`` joins a running (simulated) run, samples for it, and
leaves with the run's stop; the run's accounting includes it and Prometheus scrapes it."""

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


def test_a_generator_joins_a_running_run_and_is_accounted_for(tmp_path):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=join",
            "run.num_generators=1",
            "run.console=quiet",
            "learner.total_steps=40",
            "learner.batch_groups=4",
            "sampling.max_tokens=128",
            "simulation.generator.decode_step_s=0.01",  # slow enough that the run outlasts the join
        ],
    )
    result = {}
    run = threading.Thread(target=lambda: result.update(Controller(cfg).run()))
    run.start()
    run_dir = tmp_path / "join"
    hot = None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "steps.jsonl").exists():  # training is under way
            assert run.is_alive() and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        log = open(tmp_path / "generator-hot.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "asyncrl.cli", "generator", "--connect", str(run_dir), "--name", "generator-hot"]
        hot = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        run.join(300)
        assert not run.is_alive(), "the run did not finish"
        assert hot.wait(60) == 0, (tmp_path / "generator-hot.log").read_text()[-3000:]
    finally:
        if hot is not None and hot.poll() is None:
            hot.kill()
    summary = result
    assert summary["learner_steps"] == 40 and summary["reconciles"], summary
    prom = (run_dir / "metrics" / "generator-hot.prom").read_text()
    generated = [line for line in prom.splitlines() if line.startswith('asyncrl_samples_total{outcome="generated"}')]
    assert generated and float(generated[0].split()[-1]) > 0, "the joined generator sampled nothing"
    assert 'asyncrl_policy_version{component="generator-hot"}' in prom
    scrape = yaml.safe_load((run_dir / "prometheus.yml").read_text())
    assert "generator-hot" in {t["labels"]["component"] for t in scrape["scrape_configs"][0]["static_configs"]}
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 40


def test_a_joined_generator_that_dies_is_noticed_and_its_prompts_handed_out_again(tmp_path):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=joindies",
            "run.num_generators=1",
            "run.console=quiet",
            "learner.total_steps=60",
            "learner.batch_groups=4",
            "sampling.max_tokens=128",
            "simulation.generator.decode_step_s=0.01",
            "supervision.joined_timeout_s=5",
        ],
    )
    controller = Controller(cfg)
    result = {}
    run = threading.Thread(target=lambda: result.update(controller.run()))
    run.start()
    run_dir = tmp_path / "joindies"
    hot = None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "steps.jsonl").exists():
            assert run.is_alive() and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        log = open(tmp_path / "generator-hot.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "asyncrl.cli", "generator", "--connect", str(run_dir), "--name", "generator-hot"]
        hot = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while "generator-hot" not in controller.reports.joined:  # it is heard from: it samples
            assert run.is_alive() and time.monotonic() < deadline + 60, "the joined generator was never heard from"
            time.sleep(0.1)
        time.sleep(2.0)  # holding prompts of its batch
        hot.kill()
        killed_at = time.monotonic()
        while not any(d.get("joined") for d in controller.supervisor.deaths):
            assert run.is_alive(), "the run ended before the death was noticed"
            assert time.monotonic() - killed_at < 5 + 2 + 30, "the death was not noticed within the timeout"
            time.sleep(0.1)
        run.join(300)
        assert not run.is_alive(), "the run did not finish"
    finally:
        if hot is not None and hot.poll() is None:
            hot.kill()
    summary = result
    assert summary["learner_steps"] == 60, summary
    assert [(d["name"], d.get("joined")) for d in summary["deaths"]] == [("generator-hot", True)]
    ledger = summary["ledger"]
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, ledger
