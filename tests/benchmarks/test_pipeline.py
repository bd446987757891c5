import numpy as np
import pytest

from asyncrl.benchmarks.measured_run import warmup_steps
from asyncrl.benchmarks.pipeline import capacities, mode_overrides
from asyncrl.config import load_config
from asyncrl.generators.engines.mock_engine import MockEngine
from asyncrl.learner.mock_trainer import MockTrainer
from asyncrl.tasks.prompts import load_prompts


def test_sync_splits_each_batch_evenly_over_the_generators():
    cfg = load_config("configs/bench_pipeline.yaml", ["run.num_generators=3", "learner.batch_groups=16"])
    assert mode_overrides(cfg, "sync") == ["buffer.max_staleness=0", "generator.prompts_per_batch=6"]
    assert mode_overrides(cfg, "async-16") == ["buffer.max_staleness=16"]
    with pytest.raises(ValueError, match="mode \\('async-3'\\) must be one of"):
        mode_overrides(cfg, "async-3")


def test_the_window_opens_once_the_first_round_of_calls_is_trained():
    cfg = load_config("configs/bench_pipeline.yaml", ["run.num_generators=4", "generator.prompts_per_batch=8"])
    assert warmup_steps(cfg) == 2  # 4 x 8 groups arrive at once: two batches of 16
    assert warmup_steps(load_config("configs/bench_pipeline.yaml", ["run.num_generators=1"])) == 1


def test_sync_model_is_slowest_call_then_step_then_weight_load():
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        ["simulation.generator.length_sigma=0", "simulation.generator.length_median=10", "run.num_generators=4"],
    )
    cap = capacities(cfg, draws=2)
    engine, n, B = MockEngine(cfg.simulation.generator), cfg.sampling.n, cfg.learner.batch_groups
    prompt_len = float(np.mean([len(p.text) for p in load_prompts(cfg.task, "train")[:1000]]))
    call_s = engine.batch_seconds(int(prompt_len * 4 * n), np.full(4 * n, 10))  # 4 calls of 4 prompts at once
    call_s += 3 * cfg.simulation.generator.overhead_s  # continuous: the 4 prompts are submitted one by one
    step_s = MockTrainer(cfg.simulation.learner).step_seconds(int(B * n * (prompt_len + 10)))
    assert cap["sync_samples_per_s"] == pytest.approx(
        B * n / (call_s + step_s + cfg.simulation.generator.load_weights_s)
    )
    assert cap["sync_samples_per_s"] < min(
        cap["generation_samples_per_s"], cap["training_samples_per_s_at_mean_length"]
    )
