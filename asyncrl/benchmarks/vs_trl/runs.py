"""One timed run of either side, as a child process timed from the moment it is launched.

Each run is a whole command (``asyncrl train ...`` or trl's script), so its clock includes what
a user waits for: the interpreter, the imports, starting processes and engines, training, the
evaluations and the exit. ``ASYNCRL_BENCH_T0`` hands the launch time to the child, which reports
its own events (trl's steps and evaluations) against it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

T0_ENV = "ASYNCRL_BENCH_T0"
"""The launch time (``time.time()``) a timed child measures its events from."""


@dataclass
class CurvePoint:
    step: int
    t: float
    """Seconds from the command's launch."""
    t_from_first_step: float
    accuracy: float
    """Held-out greedy exact match of the policy after ``step`` steps."""


@dataclass
class SideRun:
    """What one run of one side reports; the same fields for asyncrl and trl."""

    side: str
    seed: int
    command_s: float
    """From launch to the result (the process's exit), without the evaluations that only the
    benchmark asked for (trl's curve points; asyncrl's cost the generators a little, and count)."""
    first_step_s: float
    """From launch to the first optimizer step."""
    curve: list[CurvePoint]
    samples: int
    trained_tokens: int
    train_s: float
    """From the first to the last optimizer step."""
    where: dict[str, float] = field(default_factory=dict)
    """Where the command's time went (asyncrl: its phases and, within training, the learner's
    steps, its waits and the publications; trl: set-up, sampling, training, evaluation)."""
    extra: dict = field(default_factory=dict)

    @property
    def final(self) -> float:
        return self.curve[-1].accuracy

    def samples_per_s(self) -> float:
        return self.samples / self.train_s if self.train_s > 0 else 0.0

    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.train_s if self.train_s > 0 else 0.0

    def time_to(self, accuracy: float) -> float | None:
        """Seconds from launch until the held-out accuracy first reached ``accuracy``."""
        return next((p.t for p in self.curve if p.accuracy >= accuracy - 1e-9), None)


def side_run(record: dict) -> SideRun:
    """A ``SideRun`` from its record (``dataclasses.asdict`` of one, as the benchmark's JSON holds it)."""
    return SideRun(**{**record, "curve": [CurvePoint(**p) for p in record["curve"]]})


def launch(command: list[str], log: Path, timeout_s: float) -> float:
    """Run ``command`` to its end (at most ``timeout_s``); its output to ``log``; returns its
    wall seconds. A failed run is an error naming its log."""
    env = {**os.environ, T0_ENV: repr(time.time())}
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{' '.join(command[:6])} ... ran past {timeout_s:.0f} s: see {log}") from e
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {done.returncode}: see {log}")
    return wall


def asyncrl_command(recipe: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "train", recipe, *overrides]


def read_asyncrl_run(side: str, seed: int, run_dir: Path, wall_s: float) -> SideRun:
    """The curve and figures of an ``asyncrl train`` run from its run directory.

    A held-out round scores version v (``evals.jsonl``); its time is when the learner published
    v (``steps.jsonl``: seconds from go), placed on the command's clock by the controller's phases
    (``summary.json``: ``phases_s``). The time before the controller started (the interpreter,
    the imports) is the launch's wall minus the run's own ``total_wall_s``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    phases = summary["phases_s"]
    before_run = max(0.0, wall_s - summary["total_wall_s"])
    go = before_run + phases.get("prepare", 0) + phases.get("start", 0) + phases.get("eval_before", 0)
    at = {0: 0.0, **{s["version"]: s["t"] for s in steps}}
    first = steps[0]["t"]
    curve = []
    for line in (run_dir / "evals.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") != "eval" or record.get("version") not in at:
            continue
        t = go + at[record["version"]]
        curve.append(CurvePoint(record["version"], t, t - go - first, record["exact_match"]))
    curve.sort(key=lambda p: p.step)
    step_s = summary["learner_step_s"]
    pub = summary.get("publication_to_served") or {}
    where = {
        "before_controller_s": before_run,
        **{f"{k}_s": v for k, v in phases.items()},
        "learner_steps_s": step_s["mean"] * step_s["n"],
        "learner_waits_s": sum(s.get("wait_s", 0.0) for s in steps),
        "generator_busy_fraction": summary["generator_busy_fraction"],
        "evaluation_s": sum(r.get("wall_s", 0.0) for r in summary["evals"]),
    }
    if isinstance(pub, dict) and "total_s" in pub:
        where["publication_to_served_mean_s"] = pub["total_s"].get("mean")
    return SideRun(
        side=side,
        seed=seed,
        command_s=wall_s,
        first_step_s=go + first,
        curve=curve,
        samples=summary["trained"],
        trained_tokens=summary["trained_tokens"],
        train_s=steps[-1]["t"] - first,
        where=where,
        extra={
            "dropped": summary["dropped"],
            "staleness_hist": summary["staleness_hist"],
            "reconciles": summary["reconciles"],
            "run_dir": str(run_dir),
        },
    )
