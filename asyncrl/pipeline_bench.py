"""``asyncrl bench pipeline``: the real control plane under simulated engines, mode by mode.

Each mode is one run of the real controller, dispatcher, transport, reward worker, buffer and
learner loop, with generators and learner replaced by timing models (``simulation`` section;
``configs/bench_pipeline.yaml``). Modes differ only in the staleness bound η
(``buffer.max_staleness``, which the dispatcher's admission also uses):

- ``sync`` (η = 0): generate a batch with the current weights, then train on it, as colocated
  verl/trl do; generators and learner take turns.
- ``one-step-off`` (η = 1): the next batch is generated while the learner trains on this one.
- ``async-4``, ``async-16``: generators run up to η versions ahead of the learner.

For each mode it reports samples/s and tokens/s, busy fractions, the staleness distribution,
end-to-end latency per sample, controller CPU per sample, and the ideal throughput
min(generation capacity, training capacity) computed from the same timing models; JSON to
stdout and ``OUT/pipeline.json``, a plot to ``OUT/pipeline.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from asyncrl.config import RunConfig, load_config

MODES = {"sync": 0, "one-step-off": 1, "async-4": 4, "async-16": 16}


def capacities(cfg: RunConfig, draws: int = 200) -> dict:
    """Samples/s the generators and the learner could each sustain alone, by Monte Carlo over
    the same timing models and response-length distribution the run uses."""
    from asyncrl.generators.mock_engine import MockEngine
    from asyncrl.learner.mock_trainer import MockTrainer
    from asyncrl.tasks import load_prompts

    gen_cfg, learner_cfg = cfg.simulation.generator, cfg.simulation.learner
    if gen_cfg is None or learner_cfg is None:
        raise ValueError("simulation.generator and simulation.learner must both be set for the pipeline bench")
    engine = MockEngine(gen_cfg, seed=cfg.run.seed)
    prompt_len = float(np.mean([len(p.text) for p in load_prompts(cfg.task, "train")[:1000]]))
    k, n = cfg.generator.prompts_per_batch, cfg.sampling.n
    batch_s, lengths = [], []
    for _ in range(draws):
        drawn = engine.draw_lengths(k * n, cfg.sampling.max_tokens)
        lengths.append(drawn.mean())
        batch_s.append(engine.batch_seconds(int(prompt_len * k * n), drawn))
    generation = cfg.run.num_generators * k * n / float(np.mean(batch_s))
    samples_per_step = cfg.learner.batch_groups * n
    step_s = MockTrainer(learner_cfg).step_seconds(int(samples_per_step * (prompt_len + float(np.mean(lengths)))))
    training = samples_per_step / step_s
    return {
        "generation_samples_per_s": generation,
        "training_samples_per_s": training,
        "ideal_samples_per_s": min(generation, training),
        "mean_response_tokens": float(np.mean(lengths)),
    }


def run_mode(recipe: str, overrides: list[str], mode: str, out: Path) -> dict:
    from asyncrl.controller import Controller

    eta = MODES[mode]
    cfg = load_config(recipe, [*overrides, f"buffer.max_staleness={eta}", f"run.name={mode}", f"run.root={out}"])
    summary = Controller(cfg).run()
    # The steady-state window, from "go" to the learner's last step: process start-up and the
    # drained stop are the same in every mode and would blur the comparison.
    trained, wall = summary["trained"], summary["train_wall_s"]
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    return {
        "eta": eta,
        "samples_per_s": trained / wall,
        "tokens_per_s": summary["trained_tokens"] / wall,
        "generator_busy_fraction": summary["generator_busy_fraction"],
        "learner_busy_fraction": summary["learner_busy_fraction"],
        "staleness_hist": hist,
        "staleness_mean": sum(k * v for k, v in hist.items()) / max(sum(hist.values()), 1),
        "latency_s": summary["latency_s"],
        "controller_cpu_us_per_sample": 1e6 * summary["controller_cpu_s"] / max(summary["generated"], 1),
        "dropped": summary["dropped"],
        "reconciles": summary["reconciles"],
        "wall_s": wall,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ideal = result["capacity"]["ideal_samples_per_s"]
    ax1.bar(modes, [result["modes"][m]["samples_per_s"] for m in modes], color="tab:blue")
    ax1.axhline(ideal, color="k", linestyle="--", label=f"ideal {ideal:.0f}/s")
    ax1.set_title("throughput (samples/s)")
    ax1.legend()
    x = np.arange(len(modes))
    ax2.bar(x - 0.2, [result["modes"][m]["generator_busy_fraction"] for m in modes], 0.4, label="generators")
    ax2.bar(x + 0.2, [result["modes"][m]["learner_busy_fraction"] for m in modes], 0.4, label="learner")
    ax2.set_xticks(x, modes)
    ax2.set_ylim(0, 1)
    ax2.set_title("busy fraction")
    ax2.legend()
    for m in modes:
        hist = result["modes"][m]["staleness_hist"]
        ks = sorted(hist)
        total = sum(hist.values())
        ax3.plot(ks, [hist[k] / total for k in ks], marker="o", label=m)
    ax3.set_title("staleness of trained samples")
    ax3.set_xlabel("versions")
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/bench_pipeline.yaml", help="recipe with a simulation section")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--out", default="runs/bench-pipeline", help="folder for the runs, JSON and plot")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every mode")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode ({m!r}) must be one of {list(MODES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, args.overrides)
    result = {"capacity": capacities(cfg), "modes": {}}
    for mode in modes:
        result["modes"][mode] = run_mode(args.config, args.overrides, mode, out)
        result["modes"][mode]["fraction_of_ideal"] = (
            result["modes"][mode]["samples_per_s"] / result["capacity"]["ideal_samples_per_s"]
        )
    if "sync" in result["modes"]:
        base = result["modes"]["sync"]["samples_per_s"]
        for m in result["modes"].values():
            m["speedup_over_sync"] = m["samples_per_s"] / base
    (out / "pipeline.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "pipeline.png")
    print(json.dumps(result, indent=2))
    return result
