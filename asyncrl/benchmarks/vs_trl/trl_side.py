"""trl's side as the harness runs and reads it (the run itself: ``asyncrl.benchmarks.vs_trl.trl_grpo``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.benchmarks.vs_trl.runs import CurvePoint, SideRun


def trl_command(recipe: str, out: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "asyncrl.benchmarks.vs_trl.trl_grpo", recipe, str(out), *overrides]


def read_trl_run(seed: int, out: Path, wall_s: float) -> SideRun:
    """``trl_grpo``'s record as a ``SideRun``: its curve is on the command's clock with the
    intermediate evaluations taken out (they are the benchmark's, not trl's); the evaluations
    before and after stay in, as asyncrl's do."""
    raise NotImplementedError
