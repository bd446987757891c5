"""The ideal of a simulated pipeline run: an upper bound on the samples/s its mode can reach.

A run trains at most what its generators produce and at most what its learner can step through,
so its ideal is the smaller of two bounds, each computed the way the run itself works:

- **Generation** (``generation_capacity``), modelled from the engine's timing model in the
  generator mode of the run. ``continuous``: a decode step over r running sequences costs
  decode_step_s + decode_s_per_seq · r and gives each a token; a group holds its q = n (+1 with
  ReMax's greedy answer) places among the b in flight (``generator.max_inflight_sequences``, else
  ``prompts_per_batch`` groups, as the simulated engine's loop sets it) from its submission until
  its longest answer M ends, so the steps S a window takes are at least Σ q · M / b over its
  groups, and its seconds at least S · decode_step_s + decode_s_per_seq · its tokens + each
  submission's overhead_s + prefill_s_per_token · prompt tokens · n (which ``MockStream`` adds to
  the batch's clock). Per generator:

      samples/s <= n / (overhead_s + prefill_s_per_token · P · n
                        + decode_s_per_seq · (n · E[L] + L_greedy) + decode_step_s · q · E[M] / b)

  ``batch``: each call waits for its longest answer, so k · n / E[call seconds] over the same
  length distribution (Monte Carlo). Trained samples are a subset of the generated ones (stale or
  truncated groups are dropped), so the bound holds for them too; G generators make G times it.
- **Training** (``training_capacity``), measured: the samples trained in the steady window over
  the learner's own step seconds for those batches (``step_s`` of each step in ``steps.jsonl``),
  the rate had the learner never waited for a batch. It is measured, not modelled from the mean
  length, because a mode trains a biased share of the lengths: an asynchronous one drops the long
  answers that ran past its staleness bound, so its batches are shorter and its steps faster than
  the mean length predicts (the old modelled ideal was beaten by 5 % this way).

``fraction_of_ideal`` = samples/s / ideal, at most 1 up to ``fraction_of_ideal_error``: for the
training bound, the delay with which the window's first step event reaches the controller
(``EVENT_DELAY_S`` over the window); for the generation bound, two standard errors of the
window's mean answer length (coefficient of variation / sqrt(samples)) plus, over the samples
trained, the sequences in flight at the window's start (G · b, which may finish inside it with
tokens decoded before it) and the buffer's stock then (what one learner step's time generates:
when generation binds, the learner has just taken what there was).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

LENGTH_DRAWS = 200_000
"""Answer lengths drawn for the mean and spread of the length distribution (standard error of the
mean about 0.3 % for a lognormal of shape 1)."""

EVENT_DELAY_S = 0.05
"""Allowance for the delay between a learner step's end and the controller's stamp of its event
(the steady window's edges are those stamps)."""


def inflight_sequences(cfg: RunConfig) -> int:
    """The most sequences a continuous generator keeps in its simulated engine
    (``asyncrl.generators.schedulers.continuous.InflightBound``; the simulated engine reports no KV capacity)."""
    per_group = cfg.sampling.n + (1 if cfg.generator.greedy_baseline else 0)
    return max(per_group, cfg.generator.max_inflight_sequences or cfg.generator.prompts_per_batch * per_group)


def mean_prompt_tokens(cfg: RunConfig) -> float:
    """Mean prompt length (the simulated engine counts characters) over the first 1000 train prompts."""
    from asyncrl.tasks.prompts import load_prompts

    return float(np.mean([len(p.text) for p in load_prompts(cfg.task, "train")[:1000]]))


def length_moments(cfg: RunConfig, draws: int = LENGTH_DRAWS) -> dict:
    """Of the answer lengths the simulated engine draws (clipped to ``sampling.max_tokens``): the
    mean, the coefficient of variation, and the mean of a group's longest (its n answers and,
    with ReMax's baseline, its greedy one)."""
    from asyncrl.generators.engines.mock_engine import MockEngine

    n = cfg.sampling.n
    engine = MockEngine(cfg.simulation.generator, seed=cfg.run.seed)
    lengths = engine.draw_lengths(max(draws // n, 1) * n, cfg.sampling.max_tokens).reshape(-1, n)  # (groups, n)
    longest = lengths.max(axis=1)
    if cfg.generator.greedy_baseline:
        longest = np.maximum(longest, engine.greedy_length(cfg.sampling.max_tokens))
    mean = float(lengths.mean())
    return {"mean": mean, "cv": float(lengths.std()) / mean, "group_longest_mean": float(longest.mean())}


def continuous_group_seconds(cfg: RunConfig, lengths: dict, prompt_tokens: float) -> float:
    """Least engine seconds one group takes on average in a continuous generator (module docstring);
    ``lengths``: ``length_moments(cfg)``."""
    from asyncrl.generators.engines.mock_engine import MockEngine

    g, n, b = cfg.simulation.generator, cfg.sampling.n, inflight_sequences(cfg)
    greedy = MockEngine(g).greedy_length(cfg.sampling.max_tokens) if cfg.generator.greedy_baseline else 0
    places = n + (1 if cfg.generator.greedy_baseline else 0)
    submission = g.overhead_s + g.prefill_s_per_token * prompt_tokens * n
    tokens = g.decode_s_per_seq * (n * lengths["mean"] + greedy)
    steps = g.decode_step_s * places * lengths["group_longest_mean"] / b  # its share of the steps
    return submission + tokens + steps


def generation_capacity(cfg: RunConfig, draws: int = 200) -> dict:
    """Samples/s the run's generators could produce if they never waited, in their generator mode
    (module docstring); ``draws`` Monte Carlo calls for the batch mode."""
    from asyncrl.generators.engines.mock_engine import MockEngine

    gen_cfg = cfg.simulation.generator
    if gen_cfg is None:
        raise ValueError("simulation.generator must be set for a modelled generation capacity")
    n, G = cfg.sampling.n, cfg.run.num_generators
    prompt_tokens = mean_prompt_tokens(cfg)
    lengths = length_moments(cfg)
    out = {"generator_mode": cfg.generator.mode, "mean_response_tokens": lengths["mean"], "length_cv": lengths["cv"]}
    if cfg.generator.mode == "continuous":
        b = inflight_sequences(cfg)
        per_group = continuous_group_seconds(cfg, lengths, prompt_tokens)
        return out | {"samples_per_s": G * n / per_group, "inflight_sequences": b}
    engine, k = MockEngine(gen_cfg, seed=cfg.run.seed), cfg.generator.prompts_per_batch
    call_s = [
        engine.batch_seconds(int(prompt_tokens * k * n), engine.draw_lengths(k * n, cfg.sampling.max_tokens))
        for _ in range(draws)
    ]
    return out | {"samples_per_s": G * k * n / float(np.mean(call_s)), "prompts_per_call": k}


def training_capacity(steps: list[dict]) -> float:
    """Samples/s the learner would have trained had it never waited for a batch: the window's
    samples over the step seconds the learner spent on them (``steps``: its ``step`` records)."""
    seconds = sum(s["step_s"] for s in steps)
    return sum(s["samples"] for s in steps) / seconds if seconds > 0 else math.inf


def mode_ideal(cfg: RunConfig, measured: dict, generation: dict) -> dict:
    """The ideal of one measured run (``run_measured``'s figures), its fraction and that fraction's
    error (module docstring); ``generation``: ``generation_capacity(cfg)``."""
    training = measured["training_capacity_samples_per_s"]
    ideal = min(generation["samples_per_s"], training)
    bound_by = "generation" if generation["samples_per_s"] < training else "training"
    trained = max(measured["trained_in_window"], 1)
    if bound_by == "training":
        error = EVENT_DELAY_S / measured["wall_s"]
    else:
        in_flight = cfg.run.num_generators * generation.get(
            "inflight_sequences", cfg.generator.prompts_per_batch * cfg.sampling.n
        )
        # The buffer's stock at the window's start: what arrived during the step before (the
        # learner, waiting on generation, had taken what was there).
        mean_step_s = measured["learner_step_s_in_window"] * cfg.learner.batch_groups * cfg.sampling.n / trained
        stock = mean_step_s * generation["samples_per_s"]
        error = 2 * generation["length_cv"] / math.sqrt(trained) + (in_flight + stock) / trained
    return {
        "generation_capacity_samples_per_s": generation["samples_per_s"],
        "training_capacity_samples_per_s": training,
        "ideal_samples_per_s": ideal,
        "ideal_bound_by": bound_by,
        "fraction_of_ideal": measured["samples_per_s"] / ideal,
        "fraction_of_ideal_error": error,
    }
