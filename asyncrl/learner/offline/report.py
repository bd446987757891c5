"""An offline run's progress: the console, ``offline_steps.jsonl``, ``evals.jsonl``, TensorBoard and W&B.

Rank 0 reports. Every step's figures go to ``RUN_DIR/offline_steps.jsonl``; every
``run.log_every`` steps (and the last) they are printed (``run.console``: plain, a line; jsonl, a
JSON object; quiet, nothing; live is taken as plain) and logged through RL's ``StepLoggers``
(``asyncrl.observability.loggers``) under ``train/``, with the step as the x axis. Evaluations go
to ``RUN_DIR/evals.jsonl``, the console and the loggers under ``eval/`` (``eval/exact_match`` as
RL logs it); the summary to ``RUN_DIR/summary.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.observability.loggers import StepLoggers

SHOWN = ("loss", "nll", "dpo_loss", "reward_accuracy", "reward_margin", "lr", "grad_norm")
"""Figures of a step printed on the plain console line, when the objective has them."""


class OfflineReport:
    def __init__(self, cfg, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.loggers = StepLoggers(cfg.logging, self.run_dir, cfg.run.name, cfg.model_dump(mode="json"))
        self.steps_file = open(self.run_dir / "offline_steps.jsonl", "a")  # noqa: SIM115  (closed in close)
        self.evals_file = open(self.run_dir / "evals.jsonl", "a")  # noqa: SIM115
        self.tokens = 0.0
        self.seconds = 0.0

    def _print(self, record: dict, line: str) -> None:
        mode = self.cfg.run.console
        if mode == "jsonl":
            print(json.dumps(record), flush=True)
        elif mode != "quiet":
            print(line, flush=True)

    def step(self, record: dict) -> None:
        self.steps_file.write(json.dumps(record) + "\n")
        self.steps_file.flush()
        self.tokens += record.get("tokens", 0.0)
        self.seconds += record["step_s"]
        step, total = record["step"], self.cfg.training.steps
        if step % self.cfg.run.log_every and step != total:
            return
        tokens_per_s = self.tokens / self.seconds if self.seconds else 0.0
        self.tokens = self.seconds = 0.0
        parts = [f"{self.cfg.objective.kind} step {step:5d}/{total}"]
        parts += [f"{key} {record[key]:.4g}" for key in SHOWN if key in record]
        parts.append(f"{record['step_s']:.2f}s/step")
        if tokens_per_s:
            parts.append(f"{tokens_per_s:.0f} tok/s")
        self._print(record, "  ".join(parts))
        scalars = {f"train/{k}": float(v) for k, v in record.items() if k != "step"}
        if tokens_per_s:
            scalars["perf/tokens_per_s"] = tokens_per_s
        self.loggers.log_scalars(scalars, step)

    def eval(self, record: dict) -> None:
        self.evals_file.write(json.dumps(record) + "\n")
        self.evals_file.flush()
        figures = {k: v for k, v in record.items() if isinstance(v, float)}
        line = f"eval at step {record['step']}: " + "  ".join(f"{k} {v:.4g}" for k, v in figures.items())
        self._print(record, line)
        self.loggers.log_scalars({f"eval/{k.removeprefix('eval_')}": v for k, v in figures.items()}, record["step"])

    def close(self, summary: dict) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.loggers.close()
        self.steps_file.close()
        self.evals_file.close()
