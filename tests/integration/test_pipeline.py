"""The real pipeline, end to end: vLLM generators, reward worker, buffer, DeepSpeed learner,
dispatcher, each its own process, talking over ZeroMQ; a few learner steps."""

import json
import math

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # vLLM generators and a DeepSpeed learner in real processes


def test_pipeline_trains_broadcasts_and_accounts_for_every_sample(tmp_path):
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=it",
            "learner.total_steps=4",
            "learner.broadcast_every=2",
            "learner.batch_groups=4",
            "generator.prompts_per_batch=4",
            "sampling.n=4",
            "buffer.max_staleness=2",
            "sft.steps=20",
            "eval.num_prompts=20",
            "learner.trainer.zero_stage=3",
            # KL to a reference policy served by its own process
            "algorithm.kl.coef=0.05",
            "algorithm.kl.reference=process",
        ],
    )
    summary = Controller(cfg).run()
    run_dir = tmp_path / "it"
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    assert summary["learner_steps"] == 4
    # every generator was told about the new weights and reports serving them
    assert summary["generator_versions"] and all(v == 4 for v in summary["generator_versions"].values())
    # every sample ends in exactly one place, and nothing is lost between processes
    assert summary["reconciles"], summary
    assert summary["generated"] == (
        summary["trained"] + sum(summary["dropped"].values()) + summary["buffered_at_end"] + summary["in_flight_at_end"]
    )
    assert all(v == 0 for v in summary["unaccounted_by_link"].values()), summary
    assert summary["trained"] == 4 * 4 * 4  # steps x groups x n
    assert sum(summary["staleness_hist"].values()) == summary["trained"]
    assert all(int(s) <= 2 for s in summary["staleness_hist"])
    assert 0 <= summary["eval_after"] <= 1 and 0 <= summary["eval_before"] <= 1
    assert (run_dir / "final" / "model.safetensors").exists()
    assert (run_dir / "config.yaml").exists()
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3, 4] and all("ref_kl" in s for s in steps)
    for name in ("buffer", "reward-0", "dispatcher", "learner", "reference", "generator-0", "generator-1"):
        assert (run_dir / "metrics" / f"{name}.port").exists()
    metrics = {
        name: (run_dir / "metrics" / f"{name}.prom").read_text()
        for name in ("buffer", "reward-0", "learner", "generator-0")
    }
    assert "asyncrl_learner_step_duration_seconds_count 4.0" in metrics["learner"]
    assert 'asyncrl_policy_version{component="learner"} 4.0' in metrics["learner"]
    assert "asyncrl_staleness_count 64.0" in metrics["learner"]
    assert "asyncrl_rollout_latency_seconds_count" in metrics["generator-0"]
    assert 'asyncrl_policy_version{component="generator-0"} 4.0' in metrics["generator-0"]
    assert "asyncrl_reward_group_duration_seconds_count" in metrics["reward-0"]
    assert "asyncrl_buffer_items" in metrics["buffer"]


def test_pipeline_with_several_updates_per_batch_a_schedule_and_truncation_masked(tmp_path):
    """The real learner loop with 2 epochs x 2 mini-batches per step, cosine decay after a warm-up
    and truncated answers masked: one version per step, the learning rate of each step's last
    update in steps.jsonl, every sample accounted for."""
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=loop",
            "learner.total_steps=3",
            "learner.broadcast_every=1",
            "learner.batch_groups=4",
            "learner.ppo_epochs=2",
            "learner.mini_batches=2",
            "learner.trainer.lr_schedule=cosine",
            "learner.trainer.lr_warmup_steps=2",
            "learner.trainer.min_lr_ratio=0.1",
            "algorithm.truncation.mode=mask",
            "generator.prompts_per_batch=4",
            "sampling.n=4",
            "sft.steps=20",
            "eval.num_prompts=20",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 3 and summary["reconciles"], summary
    assert summary["trained"] == 3 * 4 * 4
    steps = [json.loads(line) for line in (tmp_path / "loop" / "steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert [s["updates"] for s in steps] == [4, 8, 12]
    # 12 updates: warm-up over 2, then a half cosine over the other 10, to 0.1 x lr at the last
    lr = cfg.learner.trainer.lr
    expected = [lr * (0.1 + 0.9 * (1 + math.cos(math.pi * (u - 2) / 10)) / 2) for u in (3, 7, 11)]
    assert [s["lr"] for s in steps] == pytest.approx(expected, rel=1e-9)
    assert all(len(s["clipfrac_by_epoch"]) == 2 and 0 <= s["truncated_frac"] <= 1 for s in steps)
    assert all(0 <= s["grad_clipped"] <= 1 and math.isfinite(s["grad_norm"]) for s in steps)
