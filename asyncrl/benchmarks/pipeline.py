"""``asyncrl bench pipeline``: the real control plane under simulated engines, mode by mode.

Each mode is one run of the real controller, dispatcher, transport, reward worker, buffer and
learner loop, with generators and learner replaced by timing models (``simulation`` section;
``configs/bench_pipeline.yaml``). Modes differ in the staleness bound η (``buffer.max_staleness``,
which the dispatcher's admission also uses):

- ``sync`` (η = 0): generate a batch with the current weights, then train on it, as colocated
  verl/trl do; generators and learner take turns. As those systems do, the batch is split evenly
  over the generators (``generator.prompts_per_batch`` = ⌈batch_groups / num_generators⌉).
- ``one-step-off`` (η = 1): the next batch is generated while the learner trains on this one.
- ``async-4``, ``async-16``: generators run up to η versions ahead of the learner.
- ``auto``: the learner sets η step by step from its off-policy signals
  (``buffer.max_staleness: auto``; the simulated learner's signals follow
  ``simulation.learner.behaviour_kl_per_version``); its figures add the bound of each step.

For each mode it reports samples/s and tokens/s, busy fractions, the staleness distribution,
end-to-end latency per sample, CPU per sample of the controller and of each control-plane
process, and the mode's ideal, an upper bound on what it can reach (``ideal_samples_per_s``,
``asyncrl.benchmarks.capacity``): min(generation capacity in the generator mode the run uses, with
the mode's in-flight bound, modelled; training capacity, the window's samples over the learner's
own step seconds, measured), with ``fraction_of_ideal`` <= 1 up to ``fraction_of_ideal_error``.
Beside it, the synchronous throughput the same timing models predict
(``sync_samples_per_s``: per step, the slowest of the parallel generator calls, then the step,
then a weight load). Figures are over the steady state, from the step that ends the pipeline
fill to the last (``asyncrl.benchmarks.measured_run``); busy fractions and CPU come from
``asyncrl.benchmarks.steady_state``. JSON to stdout and ``OUT/pipeline.json``, a plot to
``OUT/pipeline.png``. ``--engine vllm`` runs real vLLM generators instead
(``asyncrl.benchmarks.vllm_pipeline``); ``--engine vllm --workload long-tail`` the four combinations
async/sync × continuous/batch on one vLLM engine with long-tailed answers
(``asyncrl.benchmarks.vllm_modes``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from asyncrl.benchmarks.measured_run import run_measured
from asyncrl.config import RunConfig, load_config

MODES: dict[str, int | str] = {"sync": 0, "one-step-off": 1, "async-4": 4, "async-16": 16, "auto": "auto"}


def mode_overrides(cfg: RunConfig, mode: str) -> list[str]:
    """Dotted overrides that turn a recipe into ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode ({mode!r}) must be one of {list(MODES)}")
    out = [f"buffer.max_staleness={MODES[mode]}"]
    if mode == "sync":
        out.append(f"generator.prompts_per_batch={sync_prompts_per_call(cfg)}")
    return out


def sync_prompts_per_call(cfg: RunConfig) -> int:
    return math.ceil(cfg.learner.batch_groups / cfg.run.num_generators)


def capacities(cfg: RunConfig, draws: int = 200) -> dict:
    """What the timing models predict for ``cfg``: the generators' capacity in its generator mode
    (``asyncrl.benchmarks.capacity.generation_capacity``, the generation side of each mode's
    ideal), the learner's at the mean answer length (a prediction, not a bound: a mode that drops
    long stale answers trains shorter ones faster; each mode's ideal takes the learner's measured
    step seconds instead), and the synchronous throughput (``sync_samples_per_s``: per step, the
    slowest of the parallel generator calls, then the step, then a weight load), by Monte Carlo
    over the same response-length distribution the run uses."""
    from asyncrl.benchmarks.capacity import generation_capacity, mean_prompt_tokens
    from asyncrl.generators.engines.mock_engine import MockEngine
    from asyncrl.learner.mock_trainer import MockTrainer

    gen_cfg, learner_cfg = cfg.simulation.generator, cfg.simulation.learner
    if gen_cfg is None or learner_cfg is None:
        raise ValueError("simulation.generator and simulation.learner must both be set for the pipeline bench")
    generation = generation_capacity(cfg, draws)
    engine = MockEngine(gen_cfg, seed=cfg.run.seed)
    prompt_len = mean_prompt_tokens(cfg)
    n, G, B = cfg.sampling.n, cfg.run.num_generators, cfg.learner.batch_groups
    mean_len = generation["mean_response_tokens"]
    step_s = MockTrainer(learner_cfg).step_seconds(int(B * n * (prompt_len + mean_len)))
    # Synchronous: each step's B prompts go out as calls of k_s prompts, G at a time; the step
    # waits for the slowest call of each round, then trains, then the generators load weights.
    # A continuous generator submits a call's prompts one group at a time (one overhead each).
    k_s = sync_prompts_per_call(cfg)
    calls = [min(k_s, B - i) for i in range(0, B, k_s)]
    per_group = gen_cfg.overhead_s if cfg.generator.mode == "continuous" else 0.0
    sync_gen = []
    for _ in range(draws):
        total = 0.0
        for r in range(0, len(calls), G):
            total += max(
                engine.batch_seconds(int(prompt_len * c * n), engine.draw_lengths(c * n, cfg.sampling.max_tokens))
                + (c - 1) * per_group
                for c in calls[r : r + G]
            )
        sync_gen.append(total)
    sync_step = float(np.mean(sync_gen)) + step_s + gen_cfg.load_weights_s
    return {
        "generator_mode": cfg.generator.mode,
        "generation_samples_per_s": generation["samples_per_s"],
        **({"inflight_sequences": generation["inflight_sequences"]} if "inflight_sequences" in generation else {}),
        "training_samples_per_s_at_mean_length": B * n / step_s,
        "sync_samples_per_s": B * n / sync_step,
        "sync_step_s": {"generate": float(np.mean(sync_gen)), "train": step_s, "load_weights": gen_cfg.load_weights_s},
        "mean_response_tokens": mean_len,
    }


def run_mode(recipe: str, overrides: list[str], mode: str, out: Path) -> dict:
    """One run of ``mode``; its figures over the steady-state window, with its ideal and the
    fraction of it reached (``asyncrl.benchmarks.capacity``)."""
    from asyncrl.benchmarks.capacity import generation_capacity, mode_ideal

    base = load_config(recipe, overrides)
    cfg = load_config(recipe, [*overrides, *mode_overrides(base, mode), f"run.name={mode}", f"run.root={out}"])
    measured = run_measured(cfg) | {"eta": MODES[mode]}
    return measured | mode_ideal(cfg, measured, generation_capacity(cfg))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    cap = result["capacity"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    rates = [result["modes"][m]["samples_per_s"] for m in modes]
    bars = ax1.bar(modes, rates, color="tab:blue")
    for bar, m in zip(bars, modes):
        ax1.annotate(
            f"{result['modes'][m]['fraction_of_ideal']:.2f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, -4),
            textcoords="offset points",
            ha="center",
            va="top",
            color="white",
        )
    ideals = [result["modes"][m]["ideal_samples_per_s"] for m in modes]
    ax1.scatter(modes, ideals, marker="_", s=900, color="k", zorder=3, label="ideal of each mode (upper bound)")
    ax1.axhline(
        cap["sync_samples_per_s"], color="tab:red", linestyle=":", label=f"sync model {cap['sync_samples_per_s']:.0f}/s"
    )
    ax1.set_ylim(0, 1.15 * max(*ideals, *rates))
    ax1.set_title("throughput (samples/s; label: fraction of ideal)")
    ax1.legend(loc="lower right")
    x = np.arange(len(modes))
    ax2.bar(x - 0.2, [result["modes"][m]["generator_busy_fraction"] for m in modes], 0.4, label="generators")
    ax2.bar(x + 0.2, [result["modes"][m]["learner_busy_fraction"] for m in modes], 0.4, label="learner")
    ax2.axhline(0.9, color="k", linestyle=":", linewidth=1)
    ax2.set_xticks(x, modes)
    ax2.set_ylim(0, 1.05)
    ax2.set_title("busy fraction (steady state)")
    ax2.legend(loc="lower right")
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        hist = {int(k): v for k, v in result["modes"][m]["staleness_hist"].items()}  # str keys once in JSON
        total = sum(hist.values())
        ks = sorted(hist)
        ax3.bar(np.array(ks) + (i - (len(modes) - 1) / 2) * width, [hist[k] / total for k in ks], width, label=m)
    ax3.set_title("staleness of trained samples")
    ax3.set_xlabel("versions behind the learner")
    ax3.set_ylabel("fraction of samples")
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", help="recipe (default configs/bench_pipeline.yaml, or bench_vllm.yaml with --engine vllm)"
    )
    parser.add_argument("--engine", choices=["mock", "vllm"], default="mock", help="simulated or real vLLM generators")
    parser.add_argument(
        "--workload",
        choices=["fixed", "long-tail"],
        default="fixed",
        help="with --engine vllm: fixed (the pipeline's overhead around the engine) or long-tail "
        "(async/sync x continuous/batch, asyncrl.benchmarks.vllm_modes)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--out", default="runs/bench-pipeline", help="folder for the runs, JSON and plot")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every mode")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.engine == "vllm" and args.workload == "long-tail":
        from asyncrl.benchmarks.vllm_modes import run_modes_bench

        result = run_modes_bench(args.config or "configs/bench_vllm_modes.yaml", args.overrides, out)
        print(json.dumps(result, indent=2))
        return result
    if args.workload != "fixed":
        raise ValueError(f"--workload {args.workload} needs --engine vllm")
    if args.engine == "vllm":
        from asyncrl.benchmarks.vllm_pipeline import run_vllm_bench

        result = run_vllm_bench(args.config or "configs/bench_vllm.yaml", args.overrides, out)
        print(json.dumps(result, indent=2))
        return result
    recipe = args.config or "configs/bench_pipeline.yaml"
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode ({m!r}) must be one of {list(MODES)}")
    cfg = load_config(recipe, args.overrides)
    from asyncrl.benchmarks.steady_state import machine_load

    result = {"capacity": capacities(cfg), "modes": {}, "machine_at_start": machine_load()}
    for mode in modes:
        result["modes"][mode] = run_mode(recipe, args.overrides, mode, out)
    if "sync" in result["modes"]:
        sync = result["modes"]["sync"]
        sync["fraction_of_sync_model"] = sync["samples_per_s"] / result["capacity"]["sync_samples_per_s"]
        for m in result["modes"].values():
            m["speedup_over_sync"] = m["samples_per_s"] / sync["samples_per_s"]
    result["machine_at_end"] = machine_load()
    (out / "pipeline.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "pipeline.png")
    print(json.dumps(result, indent=2))
    return result
