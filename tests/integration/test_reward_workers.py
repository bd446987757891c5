"""Real reward worker processes scoring through a real local HTTP scorer: a hot-plugged worker joins
a running stream and leaves it without losing or duplicating a sample; failed groups are requeued
or dropped by reason; the ledger over every reward process reconciles."""

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl import wire
from asyncrl.config import RunConfig
from asyncrl.wire.sockets import StreamSender
from tests.factories import make_group
from tests.integration.harness import Harness, process_metric
from tests.rewards.fault_server import FaultServer
from tests.waits import wait_until

pytestmark = pytest.mark.slow


def start_hot_worker(h: Harness, name: str, *overrides: str, connect: str | None = None) -> None:
    log = open(h.run_dir / f"{name}.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "reward-worker",
        "--connect",
        connect or str(h.run_dir),
        "--name",
        name,
        *overrides,
    ]
    h.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def scorer_config(url: str, **reward) -> RunConfig:
    spec = {"kind": "http_json", "name": "scorer", "options": {"url": url, "timeout_s": 5, "max_retries": 0}}
    return RunConfig(buffer={"max_staleness": None}, sampling={"n": 4}, reward={"rewards": [spec], **reward})


def test_a_hot_plugged_worker_joins_and_leaves_without_losing_a_sample(tmp_path):
    server = FaultServer(lambda key, attempt, body: ("sleep", 0.3, 1.0))
    h = Harness(tmp_path, scorer_config(server.url, concurrency=2))
    try:
        h.start("buffer", "buffer")
        h.start("reward", "reward-0")
        start_hot_worker(h, "reward-hot", "reward.concurrency=4")
        for name in ("buffer", "reward-0", "reward-hot"):
            h.wait_for(name, "ready")
        to_reward = StreamSender(h.endpoints.reward_in, name="test.generator")
        groups = [make_group(f"g{i}") for i in range(30)]
        for g in groups:
            to_reward.send_frame(wire.encode_group(g), timeout=5)
        wait_until(
            lambda: process_metric(tmp_path, "reward-hot", "asyncrl_reward_requests_total", 'reward="scorer"') > 0,
            "the hot-plugged worker to be scoring",
            interval=0.1,
        )
        h.procs["reward-hot"].send_signal(signal.SIGTERM)  # leaves mid-stream, holding groups
        hot = h.wait_for("reward-hot", "final", timeout=30)
        assert h.procs["reward-hot"].wait(30) == 0
        start_hot_worker(h, "reward-hot2", connect=h.endpoints.reward_share)  # a second one joins by address
        h.wait_for("reward-hot2", "ready")
        finals = h.stop(["reward"], ["reward-0", "reward-hot2"], timeout=60)
        finals["reward-hot"] = hot
        finals.update(h.stop(["buffer"], ["buffer"]))
    finally:
        h.close()
        server.close()

    rewards = [finals[n] for n in ("reward-0", "reward-hot", "reward-hot2")]
    assert hot.received > 0 and hot.held == 0 and hot.forwarded == hot.received
    assert sum(r.received for r in rewards) == 120  # what the generators sent, counted once
    assert sum(r.forwarded for r in rewards) == 120 and sum(r.held for r in rewards) == 0
    assert finals["buffer"].inserted == 120 and finals["buffer"].dropped == {}  # no duplicate
    assert finals["buffer"].held == 120
    # Each sample was scored exactly once, with its uid in the idempotency key (the server reads it back).
    assert sorted(server.attempts) == sorted(s.uid for g in groups for s in g.samples)
    assert set(server.attempts.values()) == {1}


def test_failed_groups_are_requeued_then_dropped_by_reason(tmp_path):
    def faults(key, attempt, body):
        group = key.split("/")[0]
        if key == "flaky/0" and attempt == 1:  # one sample of the group fails once
            return ("status", 503, None)
        if group == "broken":
            return ("status", 500, None)
        return ("ok", 0.5)

    server = FaultServer(faults)
    cfg = scorer_config(server.url, on_failure="requeue", max_requeues=1, requeue_delay_s=0.1)
    h = Harness(tmp_path, cfg)
    try:
        h.start("buffer", "buffer")
        h.start("reward", "reward-0")
        h.wait_for("buffer", "ready")
        h.wait_for("reward-0", "ready")
        to_reward = StreamSender(h.endpoints.reward_in, name="test.generator")
        for gid in ("fine", "flaky", "broken"):
            to_reward.send_frame(wire.encode_group(make_group(gid)), timeout=5)
        wait_until(
            lambda: sum(server.attempts.values()) >= 17,
            "17 scoring attempts (fine once, flaky once and its failed sample twice, broken twice)",
        )
        finals = h.stop(["reward"], ["reward-0"])
        finals.update(h.stop(["buffer"], ["buffer"]))
    finally:
        h.close()
        server.close()
    reward = finals["reward-0"]
    assert reward.received == reward.forwarded == 12 and reward.held == 0
    assert reward.requeued == 8 and reward.unscored == 4  # flaky and broken once; broken for good
    assert finals["buffer"].dropped == {"reward_failed: scorer: http_5xx": 4}
    assert finals["buffer"].held == 8
    assert server.attempts["broken/0"] == 2 and server.attempts["flaky/0"] == 2 and server.attempts["fine/0"] == 1
    assert server.attempts["flaky/1"] == 1  # requeued, the group re-requested only its unscored sample


def test_a_worker_hot_plugged_into_a_training_run_is_in_its_ledger(tmp_path):
    """``asyncrl reward-worker --connect RUN_DIR`` joins a controller's run mid-training; the run's
    stop reaches it too, and the summary's ledger reconciles with its counts in. The engines and
    the learner are simulated (``configs/bench_pipeline.yaml``): what is tested is the reward
    path, and every process on it is real."""
    import threading

    from asyncrl.config import load_config
    from asyncrl.controller.process import Controller

    server = FaultServer(lambda key, attempt, body: ("sleep", 0.2, 1.0))
    spec = {"kind": "http_json", "name": "scorer", "options": {"url": server.url, "timeout_s": 5}}
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=hot",
            "run.console=quiet",
            "learner.total_steps=6",
            "learner.batch_groups=2",
            "generator.prompts_per_batch=4",
            "sampling.n=4",
            "sampling.max_tokens=64",
            "buffer.max_staleness=null",
            "run.num_generators=1",
            "reward.concurrency=1",
        ],
    )
    cfg.reward.rewards = [spec]
    result = {}
    run = threading.Thread(target=lambda: result.update(Controller(cfg).run()))
    run.start()
    run_dir = tmp_path / "hot"
    hot = None
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics" / "reward-0.port").exists():  # the stream is up
            assert run.is_alive() and time.monotonic() < deadline, "the run did not start its reward worker"
            time.sleep(0.5)
        log = open(tmp_path / "reward-hot.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "asyncrl.cli", "reward-worker", "--connect", str(run_dir), "--name", "reward-hot"]
        hot = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        run.join(300)
        assert not run.is_alive(), "the run did not finish"
        assert hot.wait(60) == 0  # the run's stop reached it: it drained and left
    finally:
        if hot is not None and hot.poll() is None:
            hot.kill()
        server.close()
    summary = result
    assert summary["learner_steps"] == 6 and summary["reconciles"], summary
    assert all(v == 0 for v in summary["unaccounted_by_link"].values()), summary
    prom = (run_dir / "metrics" / "reward-hot.prom").read_text()
    scored = [line for line in prom.splitlines() if line.startswith('asyncrl_samples_total{outcome="scored"}')]
    assert scored and float(scored[0].split()[-1]) > 0, "the hot-plugged worker scored nothing"


def test_an_owner_and_a_hot_plugged_worker_share_the_judges_concurrency(tmp_path):
    """The judge allows 3 requests in flight: with a worker joined, each process's own limit would
    let it see 6; leased a share each, it never sees more than 3, and both workers score."""
    server = FaultServer(lambda key, attempt, body: ("sleep", 0.1, 1.0))
    spec = {"kind": "http_json", "name": "scorer", "options": {"url": server.url, "concurrency": 3, "max_retries": 0}}
    cfg = RunConfig(buffer={"max_staleness": None}, sampling={"n": 4}, reward={"rewards": [spec], "concurrency": 4})
    h = Harness(tmp_path, cfg)
    try:
        h.start("buffer", "buffer")
        h.start("reward", "reward-0")
        start_hot_worker(h, "reward-hot")
        for name in ("buffer", "reward-0", "reward-hot"):
            h.wait_for(name, "ready")
        to_reward = StreamSender(h.endpoints.reward_in, name="test.generator")
        for i in range(40):
            to_reward.send_frame(wire.encode_group(make_group(f"g{i}")), timeout=5)
        wait_until(  # a stop ends the asking: let the joined worker take its part first
            lambda: process_metric(tmp_path, "reward-hot", "asyncrl_reward_requests_total", 'reward="scorer"') > 8,
            "the hot-plugged worker to be scoring",
            interval=0.1,
        )
        finals = h.stop(["reward"], ["reward-0", "reward-hot"], timeout=60)
        finals.update(h.stop(["buffer"], ["buffer"]))
    finally:
        h.close()
        server.close()
    assert finals["buffer"].inserted == 160
    assert finals["reward-0"].forwarded > 0 and finals["reward-hot"].forwarded > 0
    assert server.max_in_flight <= 3, server.max_in_flight
