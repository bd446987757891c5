"""``asyncrl generator --connect RUN_DIR|ADDRESS``: one more generator joins a running run.

It reads the run's resolved config and endpoints from the run directory (or asks the run's
first reward worker for them at its ``reward_share`` address, as ``asyncrl reward-worker``
does), then runs the same generator loop as the controller's own generators: prompts from the
dispatcher (which admits by the same staleness budget, whoever asks), groups to the reward
workers, the newest published weights before each batch. The controller hears its events
like any process's, so its final counts enter the run's accounting. It stops with the run's
"stop", or on SIGTERM/SIGINT after the batch it is sampling (nothing half-sampled is lost).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from asyncrl.fleet.context import ProcessContext, configure_process

log = logging.getLogger(__name__)

SECTIONS = ("generator.", "engine.", "sampling.")
"""The config sections a joining generator may override (the rest is the run's)."""


class JoinedContext(ProcessContext):
    """A process context that also stops when this process is told to leave by a signal."""

    leaving = False

    def stop_requested(self) -> bool:
        return self.leaving or super().stop_requested()


def starting_model(run_dir: Path | None, cfg) -> str:
    """The model a run's generators started from: recorded in ``RUN_DIR/model_dir``, else the
    warm-started or built model in ``RUN_DIR/model``, else ``model.path``; a simulated engine
    needs none. The newest published weights replace it before the first batch."""
    if cfg.simulation.generator is not None:
        return "none"
    if run_dir is not None:
        recorded = run_dir / "model_dir"
        if recorded.exists():
            return recorded.read_text().strip()
        for sub in ("warm", "base"):
            if (run_dir / "model" / sub / "config.json").exists():
                return str(run_dir / "model" / sub)
    if cfg.model.path is None:
        raise SystemExit("no starting model in the run directory and model.path is None: pass --model DIR")
    return cfg.model.path


def run_joined_generator(connect: str, name: str, model: str | None, overrides: list[str]) -> int:
    from asyncrl.cli import fetch_run
    from asyncrl.config import RunConfig
    from asyncrl.configbase import apply_overrides
    from asyncrl.generators.process import run_generator

    bad = [o for o in overrides if not o.startswith(SECTIONS)]
    if bad:
        raise SystemExit(f"overrides ({bad}) must be of the sections {SECTIONS}, e.g. engine.seed=7")
    configure_process()
    if "://" in connect:  # an address: the owner of the stream tells us the run's config and endpoints
        cfg, endpoints = fetch_run(connect)
        ctx, run_dir = JoinedContext("generator", name, None, cfg, endpoints), None
    else:
        ctx, run_dir = JoinedContext("generator", name, connect), Path(connect)
    ctx.cfg = RunConfig(**apply_overrides(ctx.cfg.model_dump(mode="json"), overrides))
    model_dir = model or starting_model(run_dir, ctx.cfg)

    def leave(signum, _frame):
        log.info("%s: signal %d: finishing its batch, then leaving", name, signum)
        ctx.leaving = True

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    if run_dir is not None:
        from asyncrl.observability.scrape import write_scrape_config

        write_scrape_config(run_dir)  # Prometheus scrapes the newcomer too
    try:
        run_generator(ctx, model_dir)
    finally:
        ctx.close()
    return 0
