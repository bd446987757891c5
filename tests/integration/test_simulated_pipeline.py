"""The whole control plane with simulated engines: four generators, reward worker, buffer,
dispatcher and learner loop as real processes, a few seconds of simulated work."""

from asyncrl.config import load_config
from asyncrl.controller import Controller
from asyncrl.pipeline_bench import capacities


def test_simulated_fleet_runs_async_within_the_staleness_bound_and_reconciles(tmp_path):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "learner.total_steps=8",
            "sampling.max_tokens=128",
            "buffer.max_staleness=2",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 8 and summary["reconciles"], summary
    assert all(v == 0 for v in summary["unaccounted_by_link"].values())
    assert summary["eval_before"] is None  # a simulated learner has no model to evaluate
    assert max(int(k) for k in summary["staleness_hist"]) <= 2
    assert sum(summary["staleness_hist"].values()) == summary["trained"] == 8 * 16 * 8
    assert summary["latency_s"]["p95"] >= summary["latency_s"]["p50"] > 0
    assert len(summary["generator_versions"]) == 4 and set(summary["generator_versions"].values()) == {8}


def test_capacities_come_from_the_timing_models():
    cfg = load_config(
        "configs/bench_pipeline.yaml", ["simulation.generator.length_sigma=0", "simulation.generator.length_median=10"]
    )
    cap = capacities(cfg, draws=3)
    assert cap["mean_response_tokens"] == 10
    assert cap["ideal_samples_per_s"] == min(cap["generation_samples_per_s"], cap["training_samples_per_s"])
