"""Benchmark: the real-model recipe's figures, from a run of it.

Runs ``configs/grpo_smollm2_arithmetic.yaml`` (SmolLM2-135M-Instruct by asynchronous GRPO on the
times table in words; ``--run-dir`` reads a run that already finished instead) and writes, from
the run's own records (summary.json, steps.jsonl, evals.jsonl, probes.jsonl):

- the learning curve: every held-out round (greedy accuracy, completed correctness, mean@k,
  pass@k) by version and by seconds from the command's start, and the gain of the last round
  over the first;
- learner step seconds; generated and trained tokens per second over the RL phase;
- publication -> served seconds per version (and its stages);
- peak resident memory per process;
- the probe's mismatch per version, and the learner's mismatch KL (k3, staleness-0 tokens);
- whether the run reconciles (the ledger).

Writes bench/results/real_model_smollm2.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/real_model.py [--run-dir runs/grpo_smollm2_arithmetic] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "configs/grpo_smollm2_arithmetic.yaml"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def figures(run_dir: Path, command_s: float | None) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps, evals, probes = (
        lines(run_dir / "steps.jsonl"),
        lines(run_dir / "evals.jsonl"),
        lines(run_dir / "probes.jsonl"),
    )
    curve = [
        {
            "label": e.get("label"),
            "version": e.get("version"),
            "greedy": e.get("exact_match"),
            "completed": e.get("completed"),
            "completed_accuracy": e.get("completed_accuracy"),
            "mean_at_k": e.get("mean_at_k"),
            "pass_at_k": e.get("pass_at_k"),
            "k": e.get("samples_k"),
            "prompts": e.get("num_prompts") or e.get("prompts"),
        }
        for e in evals
    ]
    rl_s = summary.get("train_wall_s") or summary.get("wall_s") or float("nan")
    kl = [
        s["mismatch_kl"] for s in steps if isinstance(s.get("mismatch_kl"), float) and not math.isnan(s["mismatch_kl"])
    ]
    return {
        "benchmark": "real_model",
        "recipe": RECIPE,
        "run_dir": str(run_dir),
        "command_s": command_s,
        "total_wall_s": summary.get("total_wall_s"),
        "rl_wall_s": rl_s,
        "learner_steps": summary.get("learner_steps"),
        "eval_curve": curve,
        "gain_greedy": (curve[-1]["greedy"] - curve[0]["greedy"]) if len(curve) >= 2 else None,
        "learner_step_s": summary.get("learner_step_s"),
        "generated_tokens_per_s": summary.get("tokens_per_s"),
        "trained_tokens_per_s": summary.get("trained_tokens", 0) / rl_s if rl_s else None,
        "publication_to_served_s": {
            k: v for k, v in summary.get("publication_to_served", {}).items() if k != "versions"
        },
        "peak_rss_bytes": summary.get("peak_rss_bytes"),
        "probe": [
            {k: p[k] for k in ("version", "mean_diff", "max_diff", "tol", "noise", "separation")} for p in probes
        ],
        "mismatch_kl_per_step": kl,
        "staleness_hist": summary.get("staleness_hist"),
        "dropped": summary.get("dropped"),
        "reconciles": summary.get("reconciles"),
        "ledger_lost": summary.get("ledger", {}).get("lost"),
        "avx512_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", help="read this finished run instead of running the recipe")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "real_model_smollm2.json"))
    parser.add_argument("overrides", nargs="*", help="dotted overrides for the recipe (e.g. learner.total_steps=8)")
    args = parser.parse_args()
    command_s = None
    if args.run_dir is None:
        name = "bench_real_model"
        start = time.monotonic()
        cmd = [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "train",
            RECIPE,
            f"run.name={name}",
            "run.console=plain",
            *args.overrides,
        ]
        subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3 * 3600)
        command_s = time.monotonic() - start
        run_dir = REPO / "runs" / name
    else:
        run_dir = Path(args.run_dir)
    out = figures(run_dir, command_s)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
