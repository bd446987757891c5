"""trl's side as the harness runs and reads it (the run itself: ``asyncrl.benchmarks.vs_trl.trl_grpo``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.benchmarks.vs_trl.runs import CurvePoint, SideRun


def trl_command(recipe: str, out: Path, overrides: list[str], eval_every: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "asyncrl.benchmarks.vs_trl.trl_grpo",
        recipe,
        str(out),
        *overrides,
        f"--eval-every={eval_every}",
    ]


def read_trl_run(seed: int, out: Path, wall_s: float) -> SideRun:
    """``trl_grpo``'s record as a ``SideRun``, with every held-out evaluation taken off trl's
    clock: they are the benchmark's (Hugging Face greedy decoding here), not trl's, and on a real
    model one takes longer than several training steps. asyncrl's evaluations stay on its own
    clock (its generators score them), so the comparison leans toward trl, never away from it."""
    r = json.loads(out.read_text())
    points = [CurvePoint(p["step"], p["t"], p["t_from_first_step"], p["accuracy"]) for p in r["curve"]]
    marks = r["setup_marks"]
    where = {
        "imports_s": marks.get("imported"),
        "data_and_model_s": marks.get("data_loaded", 0) - marks.get("imported", 0),
        "trainer_build_s": marks.get("trainer_built", 0) - marks.get("data_loaded", 0),
        "first_step_s": r["t_first_step"] - marks.get("trainer_built", 0),
        "train_s": r["train_s"],
        "evaluation_taken_off_s": r["eval_total_s"],
    }
    return SideRun(
        side="trl",
        seed=seed,
        command_s=wall_s - r["eval_total_s"],
        first_step_s=r["t_first_step"],
        curve=points,
        samples=r["samples"],
        trained_tokens=r["completion_tokens"],
        train_s=r["train_s"],
        where=where,
        extra={k: r[k] for k in ("sampler", "sampler_note", "versions", "trl_config", "mean_abs_param_change")},
    )
