"""``asyncrl bench vs-trl``: trl's GRPOTrainer and asyncrl (async and on-policy) on the same work.

    asyncrl bench vs-trl [--workload demo|smollm2] [--seeds 0 1 2] [--sides trl async sync]

Every run is a whole command launched from here and timed from its launch
(``asyncrl.benchmarks.vs_trl.runs``); seeds run one after another, the sides' order rotating
with the seed so that a neighbour's load on a shared machine falls on each side alike. The
record (``bench/results/vs_trl_<workload>.json``) holds every run's held-out curve and where its
time went, and the comparison (``asyncrl.benchmarks.vs_trl.report``); the plot sits beside it.
A record accumulates: the runs of this invocation (or, with ``--report-only``, those found in
``--root``) replace the record's runs of the same side and seed, and its other runs are kept, so
seeds and sides can be run one invocation at a time.

trl runs in one process and uses the machine's cores through torch's threads
(``--trl-threads``, by default every core asyncrl's processes share); asyncrl's processes each
run one thread, as ``asyncrl train`` sets them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from asyncrl.benchmarks.vs_trl.runs import SideRun, asyncrl_command, launch, read_asyncrl_run, side_run
from asyncrl.benchmarks.vs_trl.workloads import MODES, WORKLOADS, start_model

SIDES = ("trl", *MODES)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl bench vs-trl", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="demo")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted override for every side (repeatable)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="where the record and plot go")
    p.add_argument("--root", type=Path, default=Path("runs/bench_vs_trl"), help="run directories and the start model")
    p.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--report-only", action="store_true", help="no runs: the record and plot again from the runs in --root"
    )
    p.add_argument("--timeout-s", type=float, default=3600.0, help="longest a single run may take")
    return p.parse_args(argv)


def machine(trl_threads: int) -> dict:
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
    ]
    return {
        "cpus": os.cpu_count(),
        "cpu": names[0] if names else platform.processor(),
        "torch": torch.__version__,
        "trl_threads": trl_threads,
        "python": platform.python_version(),
    }


def run_side(side: str, seed: int, workload, model: Path, args) -> None:
    """Launch one side's command; its wall seconds go beside its log (``NAME.wall``)."""
    from asyncrl.benchmarks.vs_trl.trl_side import trl_command

    name = f"{workload.name}-{side}-s{seed}"
    common = [*workload.overrides, *args.extra, f"model.path={model}", "model.warm_start=false", f"run.seed={seed}"]
    log = args.root / f"{name}.log"
    if side == "trl":
        cfg = workload.config("async", tuple(args.extra))
        every = cfg.eval.every_versions or cfg.learner.total_steps
        command = trl_command(workload.recipe, args.root / f"{name}.json", common, every)
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(args.trl_threads)  # for trl's process only
        try:
            wall = launch(command, log, args.timeout_s)
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
    else:
        overrides = [*common, *MODES[side], f"run.root={args.root}", f"run.name={name}", "run.console=plain"]
        wall = launch(asyncrl_command(workload.recipe, overrides), log, args.timeout_s)
    (args.root / f"{name}.wall").write_text(f"{wall!r}\n")


def read_side(side: str, seed: int, workload, root: Path) -> SideRun:
    """One run's record, from what its command left in ``root``."""
    from asyncrl.benchmarks.vs_trl.trl_side import read_trl_run

    name = f"{workload.name}-{side}-s{seed}"
    wall = float((root / f"{name}.wall").read_text())
    if side == "trl":
        return read_trl_run(seed, root / f"{name}.json", wall)
    return read_asyncrl_run(side, seed, root / name, wall)


def kept_runs(path: Path, runs: list[SideRun]) -> list[SideRun]:
    """The runs of the record at ``path`` (if any) whose side and seed ``runs`` do not hold."""
    if not path.is_file():
        return []
    fresh = {(r.side, r.seed) for r in runs}
    kept = [side_run(r) for r in json.loads(path.read_text())["runs"] if (r["side"], r["seed"]) not in fresh]
    for r in kept:
        print(f"kept from {path}: {r.side}, seed {r.seed}", file=sys.stderr)
    return kept


def main(argv: list[str] | None = None) -> int:
    from asyncrl.benchmarks.vs_trl.report import plot, record

    args = parse(sys.argv[1:] if argv is None else argv)
    workload = WORKLOADS[args.workload]
    for side in args.sides:  # every configuration checked before anything runs
        if side != "trl":
            workload.config(side, tuple(args.extra))
    args.root.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = None if args.report_only else start_model(workload, args.root / "models")
    runs = []
    for i, seed in enumerate(args.seeds):
        order = args.sides[i % len(args.sides) :] + args.sides[: i % len(args.sides)]
        for side in order:
            if not args.report_only:
                run_side(side, seed, workload, model, args)
            elif not (args.root / f"{workload.name}-{side}-s{seed}.wall").is_file():
                print(f"no run of {side}, seed {seed} in {args.root}: left out", file=sys.stderr)
                continue
            run = read_side(side, seed, workload, args.root)
            print(
                json.dumps(
                    {
                        "side": side,
                        "seed": seed,
                        "command_s": round(run.command_s, 1),
                        "first_step_s": round(run.first_step_s, 1),
                        "before": run.curve[0].accuracy,
                        "after": run.final,
                    }
                ),
                flush=True,
            )
            runs.append(run)
    path = args.out / f"vs_trl_{workload.name}.json"
    runs = kept_runs(path, runs) + runs
    result = record(workload, runs, machine(args.trl_threads))
    path.write_text(json.dumps(result, indent=2))
    plot(runs, path.with_suffix(".png"), f"{workload.name}: held-out accuracy from the command")
    print(json.dumps(result["comparison"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
