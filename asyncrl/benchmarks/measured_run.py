"""One run under the real controller, measured over its steady state, for the benchmarks.

``run_measured`` is shared by ``asyncrl bench pipeline`` (``asyncrl.benchmarks.pipeline``, one run
per mode), its vLLM variant (``asyncrl.benchmarks.vllm_pipeline``) and ``bench/scale.py``. The
steady state starts at ``warmup_steps``; busy fractions and CPU come from
``asyncrl.benchmarks.steady_state``.
"""

from __future__ import annotations

import json
import logging
import math

from asyncrl.config import RunConfig

log = logging.getLogger(__name__)

PORT_RETRIES = 3
"""Runs of one configuration at most, when a port is taken between its allocation and its bind."""

CONTROL_PLANE = ("controller", "dispatcher", "reward", "buffer", "learner")
"""Processes that are the control plane: everything but the (simulated) engines."""


def run_measured(cfg: RunConfig) -> dict:
    """Run ``cfg`` under the real controller; throughput, busy fractions, CPU and message rate
    over the steady state (``warmup_steps``). Start-up, the pipeline fill and the drained stop
    are the same in every mode and would blur the comparison; the fill is reported (``fill_s``:
    from "go" to the first step)."""
    from asyncrl.benchmarks.capacity import training_capacity
    from asyncrl.benchmarks.steady_state import SteadyStateMonitor
    from asyncrl.controller.errors import RunError
    from asyncrl.controller.process import Controller

    warm = warmup_steps(cfg)
    if cfg.learner.total_steps < warm + 2:
        raise ValueError(
            f"learner.total_steps ({cfg.learner.total_steps}) must be >= {warm + 2} to measure a steady state"
        )
    for attempt in range(1, PORT_RETRIES + 1):
        controller = Controller(cfg)
        monitor = SteadyStateMonitor(controller, start_step=warm).start()
        try:
            summary = controller.run()
            break
        except RunError as e:
            # Ports are chosen free, then bound by the children: on a shared machine another
            # program can take one in between. Nothing was measured yet; run it again.
            monitor.stop()
            if "Address already in use" not in str(e) or attempt == PORT_RETRIES:
                raise
            log.warning("%s: a port was taken before it was bound (%s); running it again", cfg.run.name, e)
    window = monitor.stop()
    # The controller keeps no step history in memory (a run may last weeks); its steps.jsonl has them all.
    steps = [json.loads(line) for line in (controller.run_dir / "steps.jsonl").read_text().splitlines()]
    wall = steps[-1]["t"] - steps[warm - 1]["t"]
    trained = sum(s["samples"] for s in steps[warm:])
    tokens = summary["trained_tokens"] * trained / max(summary["trained"], 1)  # response tokens in the window
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    cpu, busy = window["cpu_s_by_role"], window["busy_s_by_role"]
    # Busy seconds over the time between the same process's two scrapes (the steps' window when
    # a role was not scraped at both ends): both span the same interval.
    span = window["busy_window_s_by_role"]
    generator_span = span.get("generator") or wall
    per_sample_us = {role: 1e6 * cpu.get(role, 0.0) / trained for role in (*CONTROL_PLANE, "generator")}
    groups = trained / cfg.sampling.n
    auto = {}
    if cfg.buffer.auto:  # the bound each step set, and why it moved
        auto["staleness_bounds"] = [s.get("staleness_bound") for s in steps]
        auto["staleness_bound_changes"] = [
            [s["version"], s["staleness_bound_reason"]] for s in steps if s.get("staleness_bound_reason")
        ]
    return {
        **auto,
        "samples_per_s": trained / wall,
        "tokens_per_s": tokens / wall,
        "trained_in_window": trained,
        # What the learner would have trained had it never waited: the window's samples over its
        # own step seconds (the training side of the ideal, asyncrl.benchmarks.capacity).
        "learner_step_s_in_window": sum(s["step_s"] for s in steps[warm:]),
        "training_capacity_samples_per_s": training_capacity(steps[warm:]),
        "generator_busy_fraction": busy.get("generator", 0.0) / (cfg.run.num_generators * generator_span),
        # A call that spans the window's start counts wholly inside it: the fraction above may pass
        # 1 by up to this (the longest call, bounded by its histogram bucket, over the window).
        "generator_busy_fraction_error": window["longest_rollout_s_bound"] / generator_span,
        "learner_busy_fraction": busy.get("learner", 0.0) / (span.get("learner") or wall),
        "busy_fractions_whole_run": {
            "generator": summary["generator_busy_fraction"],
            "learner": summary["learner_busy_fraction"],
        },
        "staleness_hist": hist,
        "staleness_mean": sum(k * v for k, v in hist.items()) / max(sum(hist.values()), 1),
        "latency_s": summary["latency_s"],
        "controller_cpu_us_per_sample": per_sample_us["controller"],
        "cpu_us_per_sample": per_sample_us,
        "control_plane_cpu_us_per_sample": sum(per_sample_us[r] for r in CONTROL_PLANE),
        # Lower bound: each group crosses two links (generator -> reward -> buffer), each generator
        # call is a request and a reply, each step a request and a reply; re-asks, status and
        # events are left out.
        "messages_per_s": (2 * groups + 2 * groups / cfg.generator.prompts_per_batch + 2 * (len(steps) - warm)) / wall,
        "fill_s": steps[0]["t"],
        "dropped": summary["dropped"],
        "reconciles": summary["reconciles"],
        "counters_reconcile": summary.get("counters_reconcile", summary["reconciles"]),
        "ledger_lost": summary.get("ledger", {}).get("lost", 0),
        "generator_versions": summary["generator_versions"],
        "wall_s": wall,
    }


def warmup_steps(cfg: RunConfig) -> int:
    """The step that opens the steady state: the first round of generator calls (one per
    generator, k prompts each) finishes at about the same time and can stock that many batches
    at once; the window starts once the learner has taken them, so it measures the rate the
    fleet sustains, not a stock built while the learner had nothing to do."""
    k = cfg.generator.prompts_per_batch
    return max(1, math.ceil(cfg.run.num_generators * k / cfg.learner.batch_groups))
