"""Benchmark: on-policy distillation learns, the student's held-out exact match rising toward its teacher's.

Builds (or finds cached) the teacher of ``configs/distill_addition.yaml`` with
``scripts/distill_teacher.py``, which scores the teacher's held-out exact match; then runs the
recipe through ``bench/learn.py`` (the student's held-out before and after, the ledger, the
timings) and writes its figures with the teacher's beside them: ``teacher_heldout``, and
``gap_closed`` = (after - before) / (teacher - before), the fraction of the student's distance
to its teacher that the run closed.

Writes bench/results/learn_distill_addition.json (``--out`` to change it). Wrap it in
``flock /tmp/asyncrl-heavy.lock`` on a shared machine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/distill.py [configs/distill_addition.yaml] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="configs/distill_addition.yaml", help="the student's recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the recipe")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "learn_distill_addition.json"))
    args = parser.parse_args()
    built = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "distill_teacher.py")],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    teacher = json.loads(built.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        learned = Path(tmp) / "learn.json"
        command = [
            sys.executable,
            str(REPO / "bench" / "learn.py"),
            args.recipe,
            *args.overrides,
            "--out",
            str(learned),
        ]
        code = subprocess.run(command, cwd=REPO).returncode
        if code != 0:
            return code
        result = json.loads(learned.read_text())
    before, after, top = result["heldout_before"], result["heldout_after"], teacher["heldout"]
    result.update(
        benchmark="learn_distill",
        teacher=teacher["teacher"],
        teacher_recipe=teacher["recipe"],
        teacher_parameters=teacher["parameters"],
        teacher_sft_steps=teacher["sft_steps"],
        teacher_heldout=top,
        gap_closed=None if None in (before, after) or top == before else (after - before) / (top - before),
    )
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"distillation: student {before:.3f} -> {after:.3f}, teacher {top:.3f} "
        f"(gap closed {result['gap_closed']:.2f}); {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
