"""``asyncrl bench pipeline --engine vllm --workload long-tail``: where the speed of asynchronous RL comes from.

Four combinations on one real vLLM engine (the CPU build's ``AsyncLLM``, through the generator's
``VLLMStream``), the same long-tailed prompts and lengths (``asyncrl.benchmarks.long_tail``), the
same seeds, the same bound on sequences in the engine, and a learner that trains in simulated time
(``asyncrl.benchmarks.timed_learner``):

==================  ==================================================================
async · continuous  the new default: the engine kept full (a group goes in as soon as one
                    leaves), weights swapped in flight, η = ``max_staleness`` versions ahead
async · batch       the batch barrier (``bound // n`` groups at a time, the next batch once
                    the slowest answer is done), weights swapped between batches, η as above
sync · continuous   η = 0: a step's groups generated with its weights, the engine kept full
                    within the step; then the generator waits for the learner and its weights
sync · batch        η = 0 and the barrier: colocated verl/trl's loop
==================  ==================================================================

Figures: trained response tokens/s over the steady state (from the end of step ``warmup_steps``
to the last), and each combination's ideal, an upper bound: min(generation capacity *in its
generator mode*, training capacity). Generation capacity is measured, not assumed: the same engine
generating alone in that mode (``continuous``: a group in as soon as one leaves; ``batch``: the
barrier), with no learner and no weight swaps, over the steady part of the run (the engine's own
token count from the start until the last group goes in: a generator in a pipeline never runs out
of prompts, so never drains), before the four combinations and after; the faster of the two is
the capacity, their spread (drift on a shared machine) the stated error of ``fraction_of_ideal``.
Training capacity is 1 / ``s_per_token``. The learner is sized from the run before.

**How the simulated learner is sized.** Its step time is chosen, not measured:
``training_over_generation`` × the generation capacity, measured before, of the mode named by
``learner_sized_to`` (``continuous``, the mode the fleet runs by default). A balanced fleet is
one whose learner keeps up with its generators in the mode they run; sizing the learner to the
batch barrier's (lower) capacity instead would make every combination learner-bound at the
barrier's speed, and continuous generation could never show in the async figure. 1.0 is the
balanced case, where overlap matters most and the ideal is hardest to reach; the batch
combinations' ideal is then their own, lower, generation capacity. The gain of async · continuous over sync · batch is split
into continuous batching (sync · continuous ÷ sync · batch) and overlap (async · continuous ÷
sync · continuous), each also as its share of the log of the whole. What continuous batching can
gain at most on this engine is measured too: tokens/s with exactly k sequences running, k = n, 2n,
... up to the bound (``engine_scaling``): the barrier's tail runs few sequences, and that costs
only as much as throughput falls with fewer of them.

Why not through the controller: the generator process samples every group with the run's one
``sampling.max_tokens``, so it cannot draw each group's length; this driver submits to the same
stream the generator drives, with the same admission rule, and leaves the control plane out (its
overhead around real engines is ``asyncrl bench pipeline --engine vllm``'s own figure).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.benchmarks.long_tail import CAP, addition_prompts, describe, draw_lengths
from asyncrl.benchmarks.provenance import measured_commit
from asyncrl.benchmarks.timed_learner import Rollout, TimedLearner
from asyncrl.configbase import Config, apply_overrides, load_yaml

POLL_S = 0.02
"""Longest wait on the engine for a finished group between two looks at the learner."""
SEEDS = (
    "each group its own seed (derive_seed(seed, group index)), as a generator seeds every request; "
    "the CPU backend runs without chunked prefill (engine.enable_chunked_prefill) so seeded requests survive "
    "the recompute an in-flight swap causes"
)
_RUN_IDS = itertools.count(1)
SCALING_TOKENS = 64
"""Answer length of ``engine_scaling``'s runs."""
COMBINATIONS = (("async", "continuous"), ("async", "batch"), ("sync", "continuous"), ("sync", "batch"))


class ModesBenchConfig(Config):
    """The four-combination benchmark (``configs/bench_vllm_modes.yaml``)."""

    n: int = Field(8, ge=1)
    """Samples per group."""
    bound: int = Field(64, ge=1)
    """Most sequences in the engine, every combination (batch: ``bound // n`` groups a batch)."""
    batch_groups: int = Field(16, ge=1)
    """Groups per learner step."""
    max_staleness: int = Field(4, ge=1)
    """η of the async combinations (the sync ones use 0)."""
    warmup_steps: int = Field(2, ge=1)
    """Steps left out of the figures: the pipeline fill."""
    steps: int = Field(8, ge=1)
    """Steps measured per combination."""
    training_over_generation: float = Field(1.0, gt=0)
    """Training capacity as a multiple of the generation capacity measured before in the mode
    ``learner_sized_to`` (sets the learner's step time)."""
    learner_sized_to: Literal["continuous", "batch"] = "continuous"
    """Whose generation capacity the learner is sized to: the mode the fleet runs (continuous, the
    default). Sized to ``batch``, every combination is held to the barrier's speed."""
    s_per_token: float | None = Field(None, gt=0)
    """The learner's seconds per response token; None: from ``training_over_generation``."""
    alone_groups: int = Field(48, ge=1)
    """Groups the engine generates alone to measure its capacity."""
    max_model_len: int = Field(CAP + 128, ge=CAP + 2)
    """The tiny model's context: the longest answer plus the prompt."""
    time_limit_s: float = Field(300.0, gt=0)
    """Longest a combination may run; past it the bench fails naming the combination."""
    seed: int = 0
    """Seed of the model, the prompts, the lengths and the engine's sampling."""


def load_modes_config(recipe: str | Path | None, overrides: list[str] = ()) -> ModesBenchConfig:
    return ModesBenchConfig(**apply_overrides(load_yaml(recipe) if recipe else {}, list(overrides)))


class Driver:
    """Feeds one engine stream for one combination (module docstring) and hands finished groups on."""

    def __init__(self, stream, weights_dir: str, cfg: ModesBenchConfig, prompts: list[str], lengths: list[int]):
        self.stream, self.weights_dir, self.cfg = stream, weights_dir, cfg
        self.prompts, self.lengths = prompts, lengths

    def submit(self, key: str, index: int, version: int) -> None:
        from asyncrl.generators.engines.vllm_engine import SamplingConfig, derive_seed

        length = self.lengths[index % len(self.lengths)]
        self.stream.submit(
            key,
            self.prompts[index % len(self.prompts)],
            SamplingConfig(n=self.cfg.n, max_tokens=length),
            seed=derive_seed(self.cfg.seed, index),  # see SEEDS
            min_tokens=length,
            ignore_eos=True,
        )

    def run(
        self, mode: Literal["continuous", "batch"], learner: TimedLearner | None, groups: int | None = None
    ) -> dict:
        """Generate under ``mode`` until ``learner`` has trained all its steps (or, alone, until
        ``groups`` groups are done); tokens generated, weight swaps and occupancy over the run, and
        alone, the steady rate: the engine's tokens from the start until the last group goes in."""
        cfg, stream, engine = self.cfg, self.stream, self.stream.engine
        run_id = next(_RUN_IDS)  # keys unique over the stream's life: an aborted group may still report
        inflight: dict[str, int] = {}
        next_index = done = tokens = swaps = 0
        swap_s = 0.0
        start, area0 = time.monotonic(), stream.load.sequence_seconds()
        tokens0, steady = stream.load.generated_tokens, None
        thread = None
        if learner is not None:
            thread = threading.Thread(target=learner.run, name="timed-learner", daemon=True)
            thread.start()

        def admits(index: int) -> bool:
            return learner.admits(index, engine.version) if learner is not None else index < groups

        while (learner is not None and not learner.done.is_set()) or (learner is None and done < groups):
            if time.monotonic() - start > cfg.time_limit_s:
                raise TimeoutError(f"{mode}: still running after time_limit_s ({cfg.time_limit_s:g} s)")
            if learner is not None and learner.version > engine.version and (mode == "continuous" or not inflight):
                swap_s += engine.load_weights(self.weights_dir, learner.version)  # in flight if groups run
                swaps += 1
            if mode == "continuous":
                while stream.running + cfg.n <= cfg.bound and admits(next_index):
                    inflight[key := f"{run_id}-{next_index}"] = engine.version
                    self.submit(key, next_index, engine.version)
                    next_index += 1
            elif not inflight:
                for _ in range(max(1, cfg.bound // cfg.n)):
                    if not admits(next_index):
                        break
                    inflight[key := f"{run_id}-{next_index}"] = engine.version
                    self.submit(key, next_index, engine.version)
                    next_index += 1
            if learner is None and steady is None and next_index >= groups:  # the last group went in
                # a steady part only if groups finished before it (else all went in at once: none)
                steady = (stream.load.generated_tokens - tokens0, time.monotonic() - start) if done else ()
            for key, completions, _greedy in stream.finished(timeout=POLL_S):
                submitted = inflight.pop(key)
                index = int(key.split("-")[1])
                lengths = [len(c.response_ids) for c in completions]
                expected = self.lengths[index % len(self.lengths)]
                if lengths != [expected] * cfg.n:
                    raise RuntimeError(f"group {index}: answers of {lengths} tokens, the workload asks {expected}")
                done += 1
                tokens += sum(lengths)
                if learner is not None:
                    segments = [c.version_segments or [[0, submitted]] for c in completions]
                    learner.put(Rollout(index, sum(lengths), len(completions), segments, lengths))
        wall = time.monotonic() - start
        occupancy = (stream.load.sequence_seconds() - area0) / wall / cfg.bound
        stream.abort(list(inflight))  # what the finished learner no longer needs
        if thread is not None:
            thread.join(timeout=10)
            if learner.error is not None:
                raise RuntimeError(f"{mode}: the learner failed: {learner.error}") from learner.error
        return {
            "generated_tokens": tokens,
            "generated_tokens_per_s": tokens / wall,
            "occupancy": occupancy,
            "weight_swaps": swaps,
            "weight_swap_s_mean": swap_s / swaps if swaps else 0.0,
            "wall_s": wall,
            "aborted_at_end": len(inflight),
            "steady_tokens_per_s": steady[0] / steady[1] if steady and steady[1] > 0 else None,
        }


def trained_figures(learner: TimedLearner, warmup: int, start: float) -> dict:
    """Trained tokens/s and staleness over the steady state (steps after ``warmup``)."""
    from collections import Counter

    steps = learner.steps
    window = steps[-1]["t"] - steps[warmup - 1]["t"]
    measured = steps[warmup:]
    staleness, tokens_by, versions = Counter(), Counter(), Counter()
    for s in measured:
        staleness.update(s["staleness"])
        tokens_by.update(s["token_staleness"])
        versions.update(s["versions_per_sample"])
    return {
        "trained_tokens_per_s": sum(s["tokens"] for s in measured) / window,
        "trained_samples_per_s": sum(s["samples"] for s in measured) / window,
        "window_s": window,
        "fill_s": steps[warmup - 1]["t"] - start,
        "learner_busy_fraction": learner.s_per_token * sum(s["tokens"] for s in measured) / window,
        "staleness_hist": dict(sorted(staleness.items())),
        "token_staleness_hist": dict(sorted(tokens_by.items())),
        "versions_per_sample": dict(sorted(versions.items())),
        "dropped_stale_groups": learner.dropped_stale,
    }


def engine_scaling(stream, weights_dir: str, cfg: ModesBenchConfig, prompts: list[str]) -> dict[int, float]:
    """Tokens/s of the engine alone with exactly k sequences running (answers of ``SCALING_TOKENS``
    each, two batches of k), for k up to the bound: what continuous batching can gain at most
    here, as it keeps more sequences running than the barrier's tail does."""
    out, k = {}, cfg.n
    while k <= cfg.bound:
        sized = cfg.model_copy(update={"bound": k})
        run = Driver(stream, weights_dir, sized, prompts, [SCALING_TOKENS]).run("batch", None, groups=2 * (k // cfg.n))
        out[k] = run["generated_tokens_per_s"]
        k *= 2
    return out


def run_modes_bench(recipe: str | None, overrides: list[str], out: Path) -> dict:
    """Build the tiny model and one engine; capacity alone, the four combinations, capacity again."""
    from asyncrl.controller.preparation import child_env, remove_short_tmp

    cfg = load_modes_config(recipe, overrides)
    if cfg.bound < cfg.n:
        raise ValueError(f"bound ({cfg.bound}) must be >= n ({cfg.n}): room for one group at least")
    out.mkdir(parents=True, exist_ok=True)
    # The engine runs in this process with a generator's environment; the keys it adds are taken
    # back at the end, so a caller's later runs (a test session) do not inherit its TMPDIR.
    added = {key: value for key, value in child_env(out).items() if key not in os.environ}
    os.environ.update(added)
    try:
        return _run_modes(cfg, out)
    finally:
        for key in added:
            os.environ.pop(key, None)
        remove_short_tmp(out)


def _run_modes(cfg, out: Path) -> dict:
    from asyncrl.benchmarks.steady_state import machine_load
    from asyncrl.generators.engines.vllm_engine import EngineConfig
    from asyncrl.generators.engines.vllm_stream import build_stream
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    groups = (cfg.warmup_steps + cfg.steps + cfg.max_staleness + 2) * cfg.batch_groups + cfg.bound
    prompts, lengths = addition_prompts(groups, cfg.seed), draw_lengths(groups, cfg.seed)
    model = build_tiny_model(TinyModelConfig(seed=cfg.seed, max_position_embeddings=cfg.max_model_len), out / "model")
    stream = build_stream(str(model), EngineConfig(max_model_len=cfg.max_model_len, max_num_seqs=max(cfg.bound, 8)))
    load_start = machine_load()
    try:
        driver = Driver(stream, str(model), cfg, prompts, lengths)
        driver.run("continuous", None, groups=4)  # warm-up: first-use allocations
        before = {m: driver.run(m, None, groups=cfg.alone_groups) for m in ("continuous", "batch")}
        by_running = engine_scaling(stream, str(model), cfg, prompts)
        generation = capacity(before)[cfg.learner_sized_to]
        s_per_token = cfg.s_per_token or 1.0 / (cfg.training_over_generation * generation)
        combos = {}
        for timing, mode in COMBINATIONS:
            learner = TimedLearner(
                cfg.batch_groups,
                cfg.max_staleness if timing == "async" else 0,
                s_per_token,
                cfg.warmup_steps + cfg.steps,
                wait_s=cfg.time_limit_s,
                version=stream.engine.version,
            )
            start = time.monotonic()
            gen = driver.run(mode, learner)
            combos[f"{timing}-{mode}"] = {**trained_figures(learner, cfg.warmup_steps, start), "generator": gen}
            print(json.dumps({f"{timing}-{mode}": round(combos[f"{timing}-{mode}"]["trained_tokens_per_s"], 1)}))
        after = {m: driver.run(m, None, groups=cfg.alone_groups) for m in ("continuous", "batch")}
    finally:
        stream.close()
    result = summarize(cfg, before, after, s_per_token, combos)
    result["tokens_per_s_by_sequences_running"] = by_running
    result["machine_at_start"], result["machine_at_end"] = load_start, machine_load()
    result["workload"] = {
        "lengths": describe(),
        "n": cfg.n,
        "mean_answer_tokens": sum(lengths) / len(lengths),
        "groups_drawn": groups,
        "seeds": SEEDS,
    }
    result["config"] = cfg.model_dump()
    result["commit"] = measured_commit()
    (out / "pipeline_vllm_modes.json").write_text(json.dumps(result, indent=2))
    return result


def capacity(alone: dict) -> dict[str, float]:
    """Generation capacity by mode, tokens/s: the steady rate of each alone run (whole-run rate
    when the run was too short to have one)."""
    return {m: r["steady_tokens_per_s"] or r["generated_tokens_per_s"] for m, r in alone.items()}


def summarize(cfg: ModesBenchConfig, before: dict, after: dict, s_per_token: float, combos: dict) -> dict:
    """Each combination's ideal (its generator mode's capacity, or training's), ratios against
    sync · batch and the split of the gain.

    The ideal is an upper bound: a combination trains at most what its engine generates (stale
    groups are dropped), and its engine generates at most what it does alone in the same mode
    (no learner, no weight swaps); of the two alone runs, before and after the combinations, the
    faster is taken, and their spread (drift of a shared machine's load) is the fraction's
    stated error. The simulated learner trains at most 1 / ``s_per_token`` tokens/s."""
    generation = {m: max(b, a) for (m, b), a in zip(capacity(before).items(), capacity(after).values())}
    spread = {m: abs(b - a) / max(b, a) for (m, b), a in zip(capacity(before).items(), capacity(after).values())}
    training = 1.0 / s_per_token
    ideal = {m: min(g, training) for m, g in generation.items()}
    rate = {k: v["trained_tokens_per_s"] for k, v in combos.items()}
    for k, v in combos.items():
        mode = k.split("-", 1)[1]
        v["ideal_tokens_per_s"] = ideal[mode]
        v["fraction_of_ideal"] = rate[k] / v["ideal_tokens_per_s"]
        v["fraction_of_ideal_error"] = spread[mode] if generation[mode] <= training else 0.0
        v["over_sync_batch"] = rate[k] / rate["sync-batch"]
    total = rate["async-continuous"] / rate["sync-batch"]
    continuous_gain = rate["sync-continuous"] / rate["sync-batch"]
    overlap_gain = rate["async-continuous"] / rate["sync-continuous"]
    return {
        "definition": "trained response tokens/s over the steady state; each combination's ideal, an upper bound = "
        "min(generation capacity in its generator mode: the engine alone in that mode, no learner, no swaps, steady "
        "part, the faster of the runs before and after; training capacity: 1 / s_per_token); fraction_of_ideal_error: "
        "the spread of the two alone runs when generation binds",
        "learner_sized_to": f"{cfg.training_over_generation:g} x the {cfg.learner_sized_to} generation capacity "
        "measured before"
        if cfg.s_per_token is None
        else f"s_per_token {cfg.s_per_token:g} (set)",
        "generation_capacity_tokens_per_s": generation,
        "generation_capacity_before_tokens_per_s": capacity(before),
        "generation_capacity_after_tokens_per_s": capacity(after),
        "generation_capacity_spread": spread,
        "training_capacity_tokens_per_s": training,
        "learner_s_per_token": s_per_token,
        "ideal_tokens_per_s": ideal,
        "alone": {"before": before, "after": after},
        "combinations": combos,
        "async_continuous_over_sync_batch": total,
        "async_continuous_fraction_of_ideal": combos["async-continuous"]["fraction_of_ideal"],
        "gain_split": {
            "continuous_batching": continuous_gain,
            "overlap": overlap_gain,
            "continuous_share_of_log_gain": math.log(continuous_gain) / math.log(total) if total > 1 else None,
            "overlap_share_of_log_gain": math.log(overlap_gain) / math.log(total) if total > 1 else None,
            "overlap_under_batch": rate["async-batch"] / rate["sync-batch"],
            "continuous_under_async": rate["async-continuous"] / rate["async-batch"],
        },
        "goals": {"async_continuous_over_sync_batch": 2.5, "async_continuous_fraction_of_ideal": 0.9},
    }
