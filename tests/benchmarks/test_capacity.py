"""Each mode's ideal is an upper bound: the simulated engines, run in simulated time, never beat it."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.benchmarks.capacity import generation_capacity, inflight_sequences, mode_ideal, training_capacity
from asyncrl.benchmarks.pipeline import mode_overrides, run_mode
from asyncrl.config import load_config
from asyncrl.generators.engines.mock_engine import MockEngine
from asyncrl.generators.engines.mock_stream import MockStream
from asyncrl.generators.engines.vllm_engine import SamplingConfig
from asyncrl.tasks.prompts import load_prompts


class SimulatedClock:
    """``time.monotonic``/``perf_counter``/``sleep`` that only move when slept: the engines' timing
    models run in simulated time, whatever the machine's load."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@pytest.fixture
def clock(monkeypatch):
    clock = SimulatedClock()
    fake = SimpleNamespace(monotonic=clock.monotonic, perf_counter=clock.perf_counter, sleep=clock.sleep)
    monkeypatch.setattr("asyncrl.generators.engines.mock_stream.time", fake)
    monkeypatch.setattr("asyncrl.generators.engines.mock_engine.time", fake)
    return clock


def generation_error(cap: dict, samples: int, in_flight: int) -> float:
    """The generation bound's stated error (``mode_ideal``): two standard errors of the mean
    length, plus the sequences in flight at the start."""
    return 2 * cap["length_cv"] / math.sqrt(samples) + in_flight / samples


def run_continuous(cfg, clock, groups: int) -> tuple[float, int]:
    """One generator kept as full as its loop keeps it (room asked for at once, each group sent when
    done) for ``groups`` groups; samples/s in simulated time, samples."""
    stream = MockStream(MockEngine(cfg.simulation.generator, seed=cfg.run.seed))
    prompts = [p.text for p in load_prompts(cfg.task, "train")[:1000]]
    sampling = SamplingConfig(n=cfg.sampling.n, max_tokens=cfg.sampling.max_tokens)
    bound, n = inflight_sequences(cfg), cfg.sampling.n
    start, submitted, samples = clock.now, 0, 0
    while samples < groups * n:
        while submitted < groups and bound - stream.running >= n:
            stream.submit(f"g{submitted}", prompts[submitted % len(prompts)], sampling)
            submitted += 1
        samples += n * len(stream.finished(timeout=1.0))
    return samples / (clock.now - start), samples


@pytest.mark.parametrize("mode", ["sync", "async-4"])
def test_a_continuous_generator_never_beats_its_modelled_capacity(clock, mode):
    base = load_config("configs/bench_pipeline.yaml", ["run.num_generators=1"])
    cfg = load_config("configs/bench_pipeline.yaml", ["run.num_generators=1", *mode_overrides(base, mode)])
    cap = generation_capacity(cfg)
    assert cap["generator_mode"] == "continuous" and cap["inflight_sequences"] == cfg.generator.prompts_per_batch * 8
    rate, samples = run_continuous(cfg, clock, groups=400)
    assert rate <= cap["samples_per_s"] * (1 + generation_error(cap, samples, cap["inflight_sequences"]))
    assert rate >= 0.85 * cap["samples_per_s"]  # and the bound is near what a full engine reaches


def test_the_batch_barrier_capacity_is_what_batch_calls_reach(clock):
    cfg = load_config("configs/bench_pipeline.yaml", ["run.num_generators=1", "generator.mode=batch"])
    cap = generation_capacity(cfg)
    engine = MockEngine(cfg.simulation.generator, seed=cfg.run.seed + 1)
    prompts = [p.text for p in load_prompts(cfg.task, "train")[: cfg.generator.prompts_per_batch]]
    sampling = SamplingConfig(n=cfg.sampling.n, max_tokens=cfg.sampling.max_tokens)
    start, calls = clock.now, 100
    for _ in range(calls):
        engine.generate(prompts, sampling)
    samples = calls * len(prompts) * cfg.sampling.n
    rate = samples / (clock.now - start)
    # A call lasts as long as the longest of its k·n answers: 1.49 s on average, coefficient of
    # variation 0.32 here; two standard errors over 100 calls are 6.4 %.
    assert rate <= cap["samples_per_s"] * (1 + 2 * 0.32 / math.sqrt(calls))
    assert rate >= 0.9 * cap["samples_per_s"]
    # Continuous batching's capacity at the same in-flight size is far higher: the barrier's is no bound of it.
    continuous = generation_capacity(load_config("configs/bench_pipeline.yaml", ["run.num_generators=1"]))
    assert continuous["samples_per_s"] > 1.5 * cap["samples_per_s"]


def test_the_training_bound_is_the_samples_over_the_learners_own_step_seconds():
    steps = [{"samples": 128, "step_s": 0.5}, {"samples": 128, "step_s": 0.3}]
    assert training_capacity(steps) == pytest.approx(256 / 0.8)
    cfg = load_config("configs/bench_pipeline.yaml", [])
    generation = {"samples_per_s": 600.0, "length_cv": 1.2, "inflight_sequences": 64}
    measured = {
        "samples_per_s": 300.0,
        "training_capacity_samples_per_s": 320.0,
        "trained_in_window": 256,
        "learner_step_s_in_window": 0.8,
        "wall_s": 0.85,
    }
    ideal = mode_ideal(cfg, measured, generation)
    assert ideal["ideal_bound_by"] == "training" and ideal["ideal_samples_per_s"] == 320.0
    assert ideal["fraction_of_ideal"] == pytest.approx(300 / 320)
    faster = mode_ideal(cfg, measured | {"training_capacity_samples_per_s": 900.0}, generation)
    assert faster["ideal_bound_by"] == "generation" and faster["ideal_samples_per_s"] == 600.0
    # Two standard errors of the mean length; 4 x 64 sequences in flight and one 0.4 s step's output at the start.
    assert faster["fraction_of_ideal_error"] == pytest.approx(2 * 1.2 / 16 + (4 * 64 + 0.4 * 600) / 256)


@pytest.mark.slow  # real processes
def test_a_simulated_run_never_beats_its_ideal(tmp_path):
    """async-4 through the real control plane with a learner ten times faster than the
    generators: generation binds, and the run stays within its modelled bound (the barrier's
    capacity, the ideal before continuous batching, it beat by 1.7x)."""
    overrides = ["learner.total_steps=10", "simulation.learner.s_per_token=2e-6"]
    m = run_mode("configs/bench_pipeline.yaml", overrides, "async-4", tmp_path)
    assert m["reconciles"] and m["ideal_bound_by"] == "generation", m
    assert m["fraction_of_ideal"] <= 1 + m["fraction_of_ideal_error"], m
    assert m["samples_per_s"] <= m["training_capacity_samples_per_s"]


def test_the_length_moments_are_those_of_the_clipped_distribution():
    cfg = load_config("configs/bench_pipeline.yaml", ["simulation.generator.lengths=[10,30]", "sampling.max_tokens=20"])
    cap = generation_capacity(cfg)
    assert cap["mean_response_tokens"] == pytest.approx(15, rel=0.01)  # 10 and min(30, 20)
    assert cap["length_cv"] == pytest.approx(np.std([10, 20]) / 15, rel=0.02)
