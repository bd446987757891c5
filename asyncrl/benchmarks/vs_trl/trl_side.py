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
    """``trl_grpo``'s record as a ``SideRun``: its curve is on the command's clock with the
    intermediate evaluations taken out (they are the benchmark's, not trl's); the evaluations
    before and after stay in, as asyncrl's do (asyncrl's intermediate ones stay in its clock: its
    generators score them between batches)."""
    r = json.loads(out.read_text())
    curve = r["curve"]
    before_s = curve[0]["eval_s"]  # trl's clock has it taken off; asyncrl's holds its own
    intermediate_s = sum(p["eval_s"] for p in curve[1:-1])
    points = [
        CurvePoint(p["step"], p["t"] + (before_s if p["step"] > 0 else 0.0), p["t_from_first_step"], p["accuracy"])
        for p in curve
    ]
    marks = r["setup_marks"]
    sampling_s = sum(s.get("sampling_s", 0.0) for s in r["steps"])
    where = {
        "imports_s": marks.get("imported"),
        "data_and_model_s": marks.get("data_loaded", 0) - marks.get("imported", 0),
        "trainer_build_s": marks.get("trainer_built", 0) - marks.get("data_loaded", 0),
        "first_step_s": r["t_first_step"] - marks.get("trainer_built", 0),
        "train_s": r["train_s"],
        "evaluation_s": r["eval_total_s"],
        "evaluation_counted_s": r["eval_total_s"] - intermediate_s,
    }
    if sampling_s:
        where["sampling_s"] = sampling_s
    return SideRun(
        side="trl",
        seed=seed,
        command_s=wall_s - intermediate_s,
        first_step_s=r["t_first_step"] + before_s,
        curve=points,
        samples=r["samples"],
        trained_tokens=r["completion_tokens"],
        train_s=r["train_s"],
        where=where,
        extra={k: r[k] for k in ("sampler", "sampler_note", "versions", "trl_config", "mean_abs_param_change")},
    )
