"""Benchmark: a multi-turn recipe learns, from the warm start's held-out success to RL's.

Runs ``asyncrl train RECIPE [overrides]`` (``--run-dir`` reads a run that already finished
instead), timing the whole command, and writes from the run's own records (summary.json,
config.yaml): held-out success before RL and after it (greedy, each held-out row played as an
episode), the gain, the command's wall seconds, the warm start's and RL's steps, the samples
trained, and whether the run reconciles (its ledger: lost, trained twice).

Writes bench/results/learn_<run name>.json (``--out`` to change it). Wrap it in
``flock /tmp/asyncrl-heavy.lock`` on a shared machine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/learn.py configs/guess_number.yaml [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

from asyncrl.config import load_config

REPO = Path(__file__).resolve().parents[1]


def figures(run_dir: Path, command_s: float | None, command: list[str] | None) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    ledger = summary["ledger"]
    return {
        "benchmark": "learn",
        "task": config["task"]["name"],
        "run_name": config["run"]["name"],
        "command": " ".join(command) if command else None,
        "run_dir": str(run_dir),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, CPU only",
        "heldout_before": before,
        "heldout_after": after,
        "gain": None if before is None or after is None else after - before,
        "heldout_prompts": config["eval"]["num_prompts"],
        "command_s": command_s,
        "total_wall_s": summary["total_wall_s"],
        "rl_wall_s": summary["wall_s"],
        "warm_start_steps": config["sft"]["steps"] if config["model"]["warm_start"] else 0,
        "learner_steps": summary["learner_steps"],
        "groups_per_step": config["learner"]["batch_groups"],
        "samples_trained": ledger["trained"],
        "samples_dropped": ledger["dropped"],
        "reconciles": summary["reconciles"],
        "lost": ledger["lost"],
        "trained_twice": ledger["trained_twice"],
        "evals": summary["evals"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="the recipe to run (with --run-dir: none)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the recipe")
    parser.add_argument("--run-dir", help="read this finished run instead of running one")
    parser.add_argument("--out", help="where to write the figures (default bench/results/learn_<run name>.json)")
    args = parser.parse_args()
    command = command_s = None
    if args.run_dir is not None:
        run_dir = Path(args.run_dir)
    else:
        if args.recipe is None:
            parser.error("give a recipe, or --run-dir")
        asyncrl = Path(sys.executable).with_name("asyncrl")
        command = [str(asyncrl), "train", args.recipe, *args.overrides]
        started = time.perf_counter()
        code = subprocess.run(command, cwd=REPO).returncode
        command_s = time.perf_counter() - started
        if code != 0:
            print(f"the run failed (exit {code})", file=sys.stderr)
            return code
        cfg = load_config(args.recipe, args.overrides)
        run_dir = REPO / cfg.run.root / cfg.run.name  # the command ran in REPO
        command = [".venv/bin/asyncrl", "train", args.recipe, *args.overrides]
    result = figures(run_dir, command_s, command)
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"learn_{result['run_name']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{result['task']}: held-out {result['heldout_before']:.3f} -> {result['heldout_after']:.3f} "
        f"in {command_s or result['total_wall_s']:.0f} s, reconciles {result['reconciles']} (lost {result['lost']}); {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
