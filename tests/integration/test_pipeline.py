"""The real pipeline, end to end: vLLM generators, reward worker, buffer, DeepSpeed learner,
dispatcher and a reference policy, each its own process, talking over ZeroMQ.

One run of four steps, with what a step can take turned on at once, pays the start-up of two
engines and a learner once; each test below reads one aspect of it. The options' behaviour at
small size is in tests/learner/ and tests/generators/; here they run together, for real:
ZeRO-3, a KL penalty to a reference policy served by its own process, 2 epochs x 2 mini-batches
per step under a cosine schedule after a warm-up, truncated answers masked, and held-out
evaluation by the generators before, during and after training.
"""

import json
import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.config import load_config
from asyncrl.controller.preparation import evaluate
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # vLLM generators and a DeepSpeed learner in real processes

STEPS, GROUPS, N, EVAL_PROMPTS = 4, 4, 4, 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(config, summary, run directory) of the module's one run."""
    root = tmp_path_factory.mktemp("pipeline")
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"run.root={root}",
            "run.name=it",
            "run.num_generators=2",
            "run.console=quiet",
            f"learner.total_steps={STEPS}",
            "learner.broadcast_every=2",
            f"learner.batch_groups={GROUPS}",
            "learner.ppo_epochs=2",
            "learner.mini_batches=2",
            "learner.trainer.lr_schedule=cosine",
            "learner.trainer.lr_warmup_steps=2",
            "learner.trainer.min_lr_ratio=0.1",
            "learner.trainer.zero_stage=3",
            "algorithm.truncation.mode=mask",
            "algorithm.kl.coef=0.05",
            "algorithm.kl.reference=process",
            "generator.prompts_per_batch=4",
            f"sampling.n={N}",
            "buffer.max_staleness=2",
            "sft.steps=20",
            f"eval.num_prompts={EVAL_PROMPTS}",
            "eval.chunk_prompts=8",
            "eval.every_versions=2",
            "eval.samples_k=2",
        ],
    )
    summary = Controller(cfg).run()
    return cfg, summary, root / "it"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_pipeline_trains_broadcasts_and_accounts_for_every_sample(run):
    _, summary, run_dir = run
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["learner_steps"] == STEPS
    # every generator was told about the new weights and reports serving them
    assert summary["generator_versions"] and all(v == STEPS for v in summary["generator_versions"].values())
    # every sample ends in exactly one place, and nothing is lost between processes
    assert summary["reconciles"], summary
    assert summary["generated"] == (
        summary["trained"] + sum(summary["dropped"].values()) + summary["buffered_at_end"] + summary["in_flight_at_end"]
    )
    assert all(v == 0 for v in summary["unaccounted_by_link"].values()), summary
    assert summary["trained"] == STEPS * GROUPS * N
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
    assert sum(summary["staleness_hist"].values()) == summary["trained"]
    assert all(int(s) <= 2 for s in summary["staleness_hist"])
    assert (run_dir / "final" / "model.safetensors").exists()
    assert (run_dir / "config.yaml").exists()


def test_several_updates_per_step_follow_the_schedule_with_a_reference_and_truncation_masked(run):
    """2 epochs x 2 mini-batches: one version per step, the learning rate of each step's last
    update in steps.jsonl, the KL to the reference reported by every step."""
    cfg, _, run_dir = run
    steps = lines(run_dir / "steps.jsonl")
    assert [s["version"] for s in steps] == [1, 2, 3, 4] and all("ref_kl" in s for s in steps)
    assert [s["updates"] for s in steps] == [4, 8, 12, 16]
    # 16 updates: warm-up over 2, then a half cosine over the other 14, to 0.1 x lr at the last
    lr = cfg.learner.trainer.lr
    expected = [lr * (0.1 + 0.9 * (1 + math.cos(math.pi * (u - 2) / 14)) / 2) for u in (3, 7, 11, 15)]
    assert [s["lr"] for s in steps] == pytest.approx(expected, rel=1e-9)
    assert all(len(s["clipfrac_by_epoch"]) == 2 and 0 <= s["truncated_frac"] <= 1 for s in steps)
    assert all(0 <= s["grad_clipped"] <= 1 and math.isfinite(s["grad_norm"]) for s in steps)


def test_every_process_exposes_its_metrics(run):
    _, _, run_dir = run
    for name in ("buffer", "reward-0", "dispatcher", "learner", "reference", "generator-0", "generator-1"):
        assert (run_dir / "metrics" / f"{name}.port").exists()
    metrics = {
        name: (run_dir / "metrics" / f"{name}.prom").read_text()
        for name in ("buffer", "reward-0", "learner", "generator-0")
    }
    assert f"asyncrl_learner_step_duration_seconds_count {float(STEPS)}" in metrics["learner"]
    assert f'asyncrl_policy_version{{component="learner"}} {float(STEPS)}' in metrics["learner"]
    assert f"asyncrl_staleness_count {float(STEPS * GROUPS * N)}" in metrics["learner"]
    assert "asyncrl_rollout_latency_seconds_count" in metrics["generator-0"]
    assert f'asyncrl_policy_version{{component="generator-0"}} {float(STEPS)}' in metrics["generator-0"]
    assert "asyncrl_reward_group_duration_seconds_count" in metrics["reward-0"]
    assert "asyncrl_buffer_items" in metrics["buffer"]


def test_generators_evaluate_before_during_and_after_training(run):
    """Held-out evaluation by the generators' vLLM engines: before RL on the served initial
    weights, during training without pausing it, after the final weights are served; scored like
    Hugging Face greedy decoding of the same weights, and never a sample."""
    cfg, summary, run_dir = run
    evals = summary["evals"]
    assert [e["label"] for e in evals] == ["before", "v2", "after"]
    assert all(e["failed"] is None and e["num_prompts"] == EVAL_PROMPTS for e in evals)
    # before RL every generator serves the initial weights; after, the final ones
    assert evals[0]["versions"] == [0, 0] and evals[-1]["versions"] == [STEPS, STEPS]
    assert evals[1]["version"] == 2 and 2 <= evals[1]["versions"][0] <= evals[1]["versions"][1] <= STEPS
    assert summary["eval_before"] == evals[0]["exact_match"] and summary["eval_after"] == evals[-1]["exact_match"]
    assert sum(evals[0]["generators"].values()) == EVAL_PROMPTS  # both generators share the work
    # sampled answers beside greedy, and completed correctness, from the real engines
    for e in evals:
        assert e["samples_k"] == 2 and 0 <= e["mean_at_k"] <= e["pass_at_k"] <= 1, e
        assert 0 <= e["completed"] <= 1 and 0 <= e["sampled_completed"] <= 1, e
        assert e["rewards"] == {"addition": "exact_match"}
    # The same greedy decoding of the same weights as Hugging Face on the CPU (float32 both):
    # equal up to a near tie flipped by kernels that sum in another order.
    for record, model in ((evals[0], run_dir / "model" / "warm"), (evals[-1], run_dir / "final")):
        assert abs(record["exact_match"] - evaluate(cfg, Path(model))) <= 2 / EVAL_PROMPTS, record
    # Evaluation is not training: the evaluation prompts are counted apart from the samples.
    assert summary["eval_prompts_answered"] == 3 * EVAL_PROMPTS


def test_evaluations_are_written_where_a_user_looks(run):
    """evals.jsonl, TensorBoard, Prometheus."""
    _, summary, run_dir = run
    evals = summary["evals"]
    assert [line["label"] for line in lines(run_dir / "evals.jsonl")] == ["before", "v2", "after"]
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    points = {e.step: e.value for e in tb.Scalars("eval/exact_match")}
    assert set(points) == {0, 2, STEPS} and points[2] == pytest.approx(evals[1]["exact_match"])
    controller = (run_dir / "metrics" / "controller.prom").read_text()
    assert f"asyncrl_eval_exact_match {float(evals[-1]['exact_match'])}" in controller
    assert f"asyncrl_eval_version {float(STEPS)}" in controller
    generators = [(run_dir / "metrics" / f"generator-{i}.prom").read_text() for i in range(2)]
    answered = sum(
        float(line.split()[1])
        for text in generators
        for line in text.splitlines()
        if line.startswith("asyncrl_eval_prompts_total")
    )
    assert answered == 3 * EVAL_PROMPTS
