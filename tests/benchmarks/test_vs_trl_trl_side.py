"""The trl side of ``asyncrl bench vs-trl``: the recipe's objective mapped onto trl, and a short run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.benchmarks.vs_trl import trl_objective
from asyncrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


def test_demo_objective_maps_to_trl(tmp_path):
    cfg = load_config(DEMO, [f"model.path={tmp_path}", "model.warm_start=false"])
    trl_objective.check_mappable(cfg)
    s = trl_objective.grpo_settings(cfg)
    # 16 prompts x 8 answers a step: trl counts the batch in completions.
    assert (s["per_device_train_batch_size"], s["num_generations"]) == (128, 8)
    assert (s["loss_type"], s["scale_rewards"], s["beta"], s["max_steps"]) == ("dapo", "group", 0.0, 120)
    assert (s["epsilon"], s["epsilon_high"], s["learning_rate"]) == (0.2, 0.2, 1e-4)


@pytest.mark.parametrize(
    "override, key",
    [("algorithm.loss_agg_mode=token-sum", "algorithm.loss_agg_mode"), ("learner.ppo_epochs=2", "learner.ppo_epochs")],
)
def test_unmapped_keys_are_refused_by_name(tmp_path, override, key):
    cfg = load_config(DEMO, [f"model.path={tmp_path}", "model.warm_start=false", override])
    with pytest.raises(ValueError, match=key):
        trl_objective.check_mappable(cfg)


def test_schedule_is_asyncrl_s(tmp_path):
    import torch

    cfg = load_config(
        DEMO,
        [
            f"model.path={tmp_path}",
            "learner.trainer.lr_schedule=cosine",
            "learner.trainer.lr_warmup_steps=2",
            "learner.total_steps=10",
        ],
    )
    optimizer, schedule = trl_objective.optimizer_and_schedule(torch.nn.Linear(2, 2), cfg)
    rates = []
    for _ in range(11):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    # Warm-up from lr / 2 (not 0), the peak, then a half cosine to 0 at update 10.
    assert rates[0] == pytest.approx(0.5e-4) and rates[1] == pytest.approx(1e-4)
    assert rates[2] == pytest.approx(1e-4) and rates[10] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(rates[1:], rates[2:]))


@pytest.mark.slow
def test_trl_side_trains_and_reports(tmp_path):
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    model = build_tiny_model(TinyModelConfig(), tmp_path / "model")
    out = tmp_path / "trl.json"
    # A fresh tiny model answers no sum right, so a format reward (a digit in the answer) gives the
    # groups a spread of rewards and the policy a gradient; exact match still decides evaluation.
    rewards = "reward.rewards=[{kind: exact_match}, {kind: format, options: {pattern: '[0-9]'}}]"
    overrides = [f"model.path={model}", "model.warm_start=false", "learner.total_steps=3", "learner.batch_groups=2"]
    overrides += ["sampling.n=4", "eval.num_prompts=8", rewards]
    env = {**os.environ, "ASYNCRL_BENCH_T0": str(time.time()), "OMP_NUM_THREADS": "1"}
    # A caller's rank rendezvous, its port held (as a test worker whose in-process learner set
    # them leaves them): trl's one process must not try to join it.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = str(held.getsockname()[1])
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.benchmarks.vs_trl.trl_grpo",
        str(DEMO),
        str(out),
        *overrides,
        "--eval-every",
        "2",
    ]
    try:
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=300)
    finally:
        held.close()

    result = json.loads(out.read_text())
    assert [e["step"] for e in result["curve"]] == [0, 2, 3]  # before, every 2 steps, after the last
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in result["curve"])
    assert [s["step"] for s in result["steps"]] == [1, 2, 3]
    assert [s["samples"] for s in result["steps"]] == [8, 8, 8] and result["samples"] == 24
    assert result["completion_tokens"] > 0 and result["tokens_per_s"] > 0
    assert result["mean_abs_param_change"] > 0
    assert any(s["grad_norm"] > 0 for s in result["steps"])
    times = [s["t"] for s in result["steps"]]
    assert times == sorted(times) and result["t_first_step"] == times[0]
    marks = result["setup_marks"]
    assert marks["imported"] <= marks["data_loaded"] <= marks["trainer_built"] <= result["t_first_step"]
    assert result["wall_with_eval_s"] == pytest.approx(result["wall_s"] + result["eval_total_s"])
    assert result["sampler"] == "generate" and result["trl_config"]["num_generations"] == 4
