"""Step metrics to TensorBoard (built in) and Weights & Biases (when installed).

The controller hands every learner "step" event to ``StepLoggers.log_step``. The x axis is the
learner version (``policy_version`` after the step), not a wall-clock or an event counter:
under asynchrony events of other kinds arrive in any order, but the learner's version only
grows, so curves of two runs line up step for step. For W&B this is declared with
``define_metric(..., step_metric="learner_version")`` rather than ``log(step=...)``, whose step
must never repeat (a held-out eval logged at the final version would be dropped).

Logged per step: every number of the step's ``StepStats`` (reward, loss, staleness, clip
fraction, KL...; ``StepStats.scalars``) under ``train/``, the throughput the console shows under ``perf/``, and the step's share of
trained answers as text under ``samples`` (``asyncrl.observability.samples``); at the end, held-out
exact match under ``eval/`` (before RL at version 0, after at the last version) and the run's
summary numbers under ``summary/``.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.observability.step_stats import StepStats

log = logging.getLogger(__name__)


class LoggingConfig(Config):
    """Where step metrics go besides ``steps.jsonl``."""

    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard (``tensorboard --logdir runs``)."""
    wandb: Literal["auto", "on", "off"] = "auto"
    """Weights & Biases: 'auto' logs when wandb is installed, 'on' requires it, 'off' never logs."""
    wandb_project: str = "asyncrl"
    """W&B project of the run (the run's name is run.name)."""
    wandb_entity: str | None = None
    """W&B entity (team or user); None: wandb's default."""
    wandb_mode: Literal["online", "offline"] | None = None
    """W&B mode; None: wandb's default (the WANDB_MODE variable, else online)."""
    samples_per_step: int = Field(1, ge=0)
    """Groups of each learner step's batch (each prompt with all its answers, rewards, reward parts,
    versions and staleness), picked at random, written to RUN_DIR/samples.jsonl (one line per
    answer) and TensorBoard's text tab; 0: none (``asyncrl inspect RUN --samples``)."""
    samples_max_chars: int = Field(2000, ge=16)
    """Longest prompt or answer text kept in a sample line; longer ones are cut, marked with '…'."""
    samples_max_bytes: int = Field(64 << 20, ge=1 << 16)
    """Size at which samples.jsonl is moved to samples.1.jsonl (replacing it) and started afresh:
    at most twice this on disk however long the run."""


class TensorBoardLogger:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], version: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=version)

    def log_text(self, tag: str, markdown: str, version: int) -> None:
        self.writer.add_text(tag, markdown, global_step=version)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, wandb, cfg: LoggingConfig, name: str, run_dir: Path, config: dict):
        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=name,
            dir=str(run_dir),
            config=config,
            mode=cfg.wandb_mode,
        )
        wandb.define_metric("learner_version")
        wandb.define_metric("*", step_metric="learner_version")

    def log(self, scalars: dict[str, float], version: int) -> None:
        self.wandb.log({"learner_version": version, **scalars})

    def close(self) -> None:
        self.run.finish()


def import_wandb(mode: str):
    """The ``wandb`` module, or None when it is not installed and ``mode`` is 'auto'."""
    if mode == "off":
        return None
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        if mode == "on":
            raise ImportError("logging.wandb is 'on' but wandb is not installed: `pip install wandb`") from e
        return None


class StepLoggers:
    """Every configured logger, fed the same scalars at the same learner version."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, name: str, config: dict | None = None):
        self.loggers: list = []
        self.last_version = -1
        if cfg.tensorboard:
            self.loggers.append(TensorBoardLogger(run_dir / "tensorboard"))
        wandb = import_wandb(cfg.wandb)
        if wandb is not None:
            self.loggers.append(WandbLogger(wandb, cfg, name, run_dir, config or {}))
        elif cfg.wandb == "auto":
            log.debug("wandb is not installed: no W&B logging")

    def log_step(self, stats: StepStats, extra: dict[str, float] | None = None) -> None:
        """One learner step at its version; a version at or below the last one logged (a repeated
        event) is skipped, so the axis stays monotonic."""
        version = stats.version
        if version <= self.last_version:
            return
        self.last_version = version
        self._log({**stats.scalars(), **(extra or {})}, version)

    def log_scalars(self, scalars: dict[str, float], version: int) -> None:
        """Scalars measured at ``version`` but reported later (a held-out evaluation during training)."""
        self._log(scalars, version)

    def log_summary(self, summary: dict) -> None:
        """Held-out exact match at versions 0 and last, and the summary's numbers at the last."""
        last = max(self.last_version, int(summary.get("learner_steps") or 0))
        if summary.get("eval_before") is not None:
            self._log({"eval/exact_match": float(summary["eval_before"])}, 0)
        numbers = {
            f"summary/{k}": float(v)
            for k, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if summary.get("eval_after") is not None:
            numbers["eval/exact_match"] = float(summary["eval_after"])
        self._log(numbers, last)

    def log_text(self, tag: str, markdown: str, version: int) -> None:
        """Text (Markdown) at ``version``: TensorBoard's text tab (W&B: not logged)."""
        for logger in self.loggers:
            if hasattr(logger, "log_text"):
                logger.log_text(tag, markdown, version)

    def _log(self, scalars: dict[str, float], version: int) -> None:
        for logger in self.loggers:
            logger.log(scalars, version)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []
