"""Control-plane scale: the async pipeline with 1 -> 256 simulated generators, until it saturates.

Each point is one run of the real controller, dispatcher, transport, reward worker, buffer and
learner loop (``configs/bench_scale.yaml``: a learner too fast to be the bottleneck), with G
simulated generators, E = ceil(G / max_processes) of them per process (threads around the
unchanged generator loop, ``asyncrl.generators.multiplex``), so 256 fit on two cores. Per point it
reports samples/s against its ideal, an upper bound (``asyncrl.benchmarks.capacity``): G x one
generator's capacity in the generator mode the run uses (from the same timing model), or the
learner's measured capacity if lower (``fraction_of_ideal`` <= 1 up to ``fraction_of_ideal_error``),
CPU µs per trajectory of each control-plane process and each process's CPU
utilisation over the steady-state window (``asyncrl.benchmarks.steady_state``), and the message rate. The
control plane saturates where samples/s stops following the ideal; the process whose
utilisation nears one core there is the bottleneck. The baseline, measured in the same run, is
one hop of the transport alone (``bench/control_plane.py``: encode, push/pull, decode on one
core) at this workload's mean length and at 1k tokens, from which bench/README.md extrapolates.

    OMP_NUM_THREADS=1 .venv/bin/python bench/scale.py [--generators 1,4,16,64,256] [--seconds 6]
        [--out bench/results] [overrides ...]

Each point runs about ``--seconds`` of steady state (plus start-up); JSON to stdout and
OUT/scale.json, a plot to OUT/scale.png.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from control_plane import make_group, through_sockets

from asyncrl.benchmarks.capacity import generation_capacity, mode_ideal
from asyncrl.benchmarks.measured_run import CONTROL_PLANE, run_measured
from asyncrl.benchmarks.pipeline import capacities
from asyncrl.benchmarks.steady_state import machine_load
from asyncrl.config import load_config


def point_overrides(generators: int, max_processes: int, seconds: float, per_generator_samples_s: float, n: int):
    """Overrides of one point: the fleet, its packing into processes, batch and run length."""
    per_process = math.ceil(generators / max_processes)
    batch_groups = 4 * generators  # one step is ~0.7 s of the fleet's output at every scale
    step_s = batch_groups * n / (generators * per_generator_samples_s)
    steps = max(10, 2 + math.ceil(seconds / step_s))  # + the warm-up steps (measured_run.warmup_steps)
    return [
        f"run.num_generators={generators}",
        f"simulation.generator.engines_per_process={per_process}",
        f"learner.batch_groups={batch_groups}",
        f"learner.total_steps={steps}",
        f"buffer.capacity_samples={6 * batch_groups * n}",  # room for η = 4 steps ahead and the batch
        f"run.name=g{generators}",
    ]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    gens = [p["generators"] for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax1.loglog(
        gens, [p["ideal_samples_per_s"] for p in points], "k--", label="ideal (G x one generator, or the learner)"
    )
    ax1.loglog(gens, [p["samples_per_s"] for p in points], "o-", label="measured")
    ax1.set_xlabel("simulated generators")
    ax1.set_ylabel("trajectories/s")
    ax1.set_title("throughput")
    ax1.legend()
    for role in (*CONTROL_PLANE, "generator"):
        ax2.semilogx(gens, [p["cpu_cores"].get(role, 0.0) for p in points], "o-", label=role)
    ax2.semilogx(gens, [sum(p["cpu_cores"].values()) for p in points], "k^-", label="all of them")
    ax2.axhline(1.0, color="k", linestyle=":", linewidth=1)
    ax2.axhline(2.0, color="k", linestyle="--", linewidth=1)
    ax2.set_xlabel("simulated generators")
    ax2.set_ylabel("CPU cores used (steady state)")
    ax2.set_title("CPU by process kind (the machine: 2 cores, shared)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/bench_scale.yaml")
    parser.add_argument("--generators", default="1,4,16,64,256", help="comma-separated fleet sizes")
    parser.add_argument("--max-processes", type=int, default=8, help="generator processes at most")
    parser.add_argument("--seconds", type=float, default=6.0, help="steady-state seconds per point")
    parser.add_argument("--out", default="runs/bench-scale")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, [*args.overrides, "run.num_generators=1"])
    cap = capacities(base)
    one = cap["generation_samples_per_s"]  # one generator's samples/s: sizes each point's run
    # Baseline in the same run: one hop (encode, ZeroMQ push/pull, decode, validate) on one core,
    # for groups of this workload's mean length and of 1k-token trajectories (bench/control_plane.py).
    hops = {
        tokens: through_sockets(make_group(0, base.sampling.n, tokens), 3.0)
        for tokens in (round(cap["mean_response_tokens"]), 1024)
    }
    result = {
        "config": args.config,
        "one_generator_samples_per_s": one,
        "mean_response_tokens": cap["mean_response_tokens"],
        "one_hop_baseline": {
            str(t): {
                "trajectories_per_s": h["trajectories_per_s"],
                "us_per_trajectory": 1e6 / h["trajectories_per_s"],
                "frame_bytes": h["frame_bytes"],
            }
            for t, h in hops.items()
        },
        "points": [],
        "machine_at_start": machine_load(),
    }
    for g in (int(x) for x in args.generators.split(",")):
        overrides = point_overrides(g, args.max_processes, args.seconds, one, base.sampling.n)
        cfg = load_config(args.config, [*args.overrides, *overrides, f"run.root={out}"])
        m = run_measured(cfg)
        ideal = mode_ideal(cfg, m, generation_capacity(cfg))
        cpu_s = {r: m["cpu_us_per_sample"][r] * 1e-6 * m["samples_per_s"] for r in m["cpu_us_per_sample"]}
        point = {
            "generators": g,
            "engines_per_process": cfg.simulation.generator.engines_per_process,
            "ideal_samples_per_s": ideal["ideal_samples_per_s"],
            "ideal_bound_by": ideal["ideal_bound_by"],
            "samples_per_s": m["samples_per_s"],
            "fraction_of_ideal": ideal["fraction_of_ideal"],
            "fraction_of_ideal_error": ideal["fraction_of_ideal_error"],
            "generator_busy_fraction": m["generator_busy_fraction"],
            "cpu_us_per_sample": m["cpu_us_per_sample"],
            "control_plane_cpu_us_per_sample": m["control_plane_cpu_us_per_sample"],
            "cpu_cores": cpu_s,  # CPU seconds per second of each process kind in the window
            "messages_per_s": m["messages_per_s"],
            "staleness_mean": m["staleness_mean"],
            "latency_s": m["latency_s"],
            "reconciles": m["reconciles"],
            "wall_s": m["wall_s"],
            "machine_at_end": machine_load(),
        }
        result["points"].append(point)
        print(json.dumps(point), flush=True)
    (out / "scale.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "scale.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
