"""A training run outlives an outage of its reward API: the simulated fleet (real processes) scores
through a local HTTP scorer that answers 503 for 10 s mid-run; the reward worker's circuit breaker
opens, probes, closes again, and the learner keeps stepping to its last step with a ledger that
reconciles. (Before the breaker's probe was fixed, it stayed open and the run died of a stall.)"""

import time

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller
from tests.rewards.fault_server import FaultServer

pytestmark = pytest.mark.slow  # real processes

OUTAGE_S = 10.0
COOLDOWN_S = 2.0


def test_the_learner_keeps_stepping_after_a_reward_api_outage(tmp_path):
    state = {"down_until": None}

    def outage(key, attempt, body):
        # Down once the run is well under way (a few learner steps' worth of samples scored).
        if state["down_until"] is None and len(server.arrivals) >= 400:
            state["down_until"] = time.monotonic() + OUTAGE_S
        if state["down_until"] is not None and time.monotonic() < state["down_until"]:
            return ("status", 503, None)
        return ("sleep", 0.01, 1.0)

    server = FaultServer(outage)
    options = {
        "url": server.url,
        "timeout_s": 5,
        "max_retries": 2,
        "backoff_base_s": 0.1,
        "breaker_failures": 5,
        "breaker_cooldown_s": COOLDOWN_S,
    }
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "learner.total_steps=16",
            "sampling.max_tokens=128",
            "buffer.max_staleness=null",
            "reward.on_failure=requeue",
            "run.stall_timeout_s=60",  # a breaker stuck open shows as a stall within the test's time
        ],
    )
    cfg.reward.rewards = [{"kind": "http_json", "name": "scorer", "options": options}]
    try:
        summary = Controller(cfg).run()
    finally:
        server.close()
    back = state["down_until"]
    assert back is not None, "the outage never started"
    assert summary["learner_steps"] == 16 and summary["reconciles"], summary
    assert all(v == 0 for v in summary["unaccounted_by_link"].values()), summary
    after = sorted(t for t in server.arrivals if t >= back)
    # Scoring resumed within the breaker's cooldown (plus slack for a loaded machine) and went on.
    assert after and after[0] - back < COOLDOWN_S + 3.0 and len(after) > 200, after[:3]
