"""Offline recipes end to end (``asyncrl sft`` / ``asyncrl dpo``): before/after figures to bench/results.

    python bench/offline.py addition     # configs/sft_addition.yaml, then configs/dpo_addition.yaml from it
                                         #   -> bench/results/offline_addition.json
    python bench/offline.py gsm8k        # configs/sft_gsm8k_smollm2.yaml -> bench/results/sft_gsm8k_smollm2.json

Each recipe runs as its command does (a subprocess, ``runs/`` under --root); the JSON holds each
run's summary (held-out figures before and after, steps, seconds), the commit and the machine.
Extra dotted overrides after the suite name apply to every recipe of it.
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

REPO = Path(__file__).resolve().parents[1]
SUITES = {
    "addition": ("offline_addition.json", [("sft", "configs/sft_addition.yaml"), ("dpo", "configs/dpo_addition.yaml")]),
    "gsm8k": ("sft_gsm8k_smollm2.json", [("sft", "configs/sft_gsm8k_smollm2.yaml")]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every recipe of the suite")
    parser.add_argument("--root", default="runs", help="folder of the run directories")
    parser.add_argument("--out", help="JSON path (default bench/results/<suite's file>)")
    args = parser.parse_intermixed_args()
    name, recipes = SUITES[args.suite]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    result = {"suite": args.suite, "commit": commit, "machine": f"{platform.node()} {os.cpu_count()} CPUs", "runs": []}
    result["load_at_start"] = os.getloadavg()
    for kind, recipe in recipes:
        started = time.time()
        command = [
            sys.executable,
            "-m",
            "asyncrl.cli",
            kind,
            str(REPO / recipe),
            f"run.root={args.root}",
            *args.overrides,
        ]
        if recipe == "configs/dpo_addition.yaml":  # from the SFT run just made, wherever --root puts it
            command.append(f"model.path={Path(args.root).resolve() / 'sft_addition' / 'final'}")
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        result["runs"].append(
            {"command": f"asyncrl {kind} {recipe}", "wall_s": round(time.time() - started, 1), **summary}
        )
        print(json.dumps(result["runs"][-1]), flush=True)
    result["load_at_end"] = os.getloadavg()
    out = Path(args.out) if args.out else REPO / "bench" / "results" / name
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
