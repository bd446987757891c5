"""The controller's one hook for progress: every event in, the console and the loggers out.

``RunProgress(cfg, run_dir)`` builds the console (``run.console``) and the step loggers
(``logging``: TensorBoard, W&B); the controller calls ``watch(fleet)`` once its processes exist,
``update(ev)`` for every event it receives, ``step(stats, t)`` for each learner step's
``StepStats`` (``t``: seconds since go), ``samples(version, samples)`` for each step's share of
answers, and ``close(summary)`` at the end (also on failure, with no summary).

The controller is a process like the others: it serves ``/metrics`` and ``/health`` too
(``RUN_DIR/metrics/controller.port``, in the scrape config), with the last learner version it
heard of as ``asyncrl_policy_version{component="controller"}``.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.observability.console import RunConsole
from asyncrl.observability.loggers import StepLoggers
from asyncrl.observability.metrics import (
    EVAL_EXACT_MATCH,
    EVAL_VERSION,
    POLICY_VERSION,
    serve_metrics,
    stop_metrics,
    write_metrics_snapshot,
)
from asyncrl.observability.samples import SamplesLog, samples_markdown
from asyncrl.observability.step_stats import StepStats

EVAL_SCALARS = (
    "exact_match",
    "completed",
    "completed_accuracy",
    "mean_at_k",
    "pass_at_k",
    "sampled_completed",
    "sampled_completed_accuracy",
    "episode_turns",
    "episode_tool_calls",
    "episode_tool_errors",
    "sampled_episode_turns",
    "sampled_episode_tool_calls",
    "sampled_episode_tool_errors",
    "env_failures",
)
"""The figures of an evaluation record (``asyncrl.tasks.eval_metrics``) that go to TensorBoard
(those a round has: the episode figures when its prompts were played as episodes)."""


class RunProgress:
    def __init__(self, cfg, run_dir: Path, out=None):
        self.console = RunConsole(cfg.run.console, cfg.learner.total_steps, cfg.run.name, out=out)
        self.run_dir = Path(run_dir)
        self.loggers = StepLoggers(cfg.logging, self.run_dir, cfg.run.name, cfg.model_dump(mode="json"))
        self.samples_log = SamplesLog(self.run_dir, cfg.logging.samples_max_bytes)
        self.metrics_port = serve_metrics(self.run_dir, "controller")
        self.closed = False

    def watch(self, fleet, eval_before: float | None = None) -> None:
        """The fleet whose processes the console follows, and the held-out score before RL."""
        self.console.watch(fleet)
        self.console.set_eval(before=eval_before)

    def set_state(self, name: str, state: str) -> None:
        """A process state no event reports (e.g. 'restarting' while the controller restarts it)."""
        self.console.components.set(name, state)

    def update(self, ev) -> None:
        """Any event (``asyncrl.wire.messages.EVENTS``): the console's process states."""
        self.console.update(ev)

    def step(self, stats: StepStats, t: float) -> None:
        """A learner step: the console, the controller's version gauge, the step loggers (its
        statistics under ``train/``, the console's rates under ``perf/``)."""
        self.console.step(stats, t)
        POLICY_VERSION.set(stats.version)
        window = self.console.steps
        rates = {"perf/tokens_per_s": window.tokens_per_s, "perf/samples_per_s": window.samples_per_s}
        self.loggers.log_step(stats, {k: v for k, v in rates.items() if v is not None})

    def samples(self, version: int, samples: list[dict]) -> None:
        """A learner step's share of answers (a ``samples`` event): one line each in
        ``samples.jsonl``, the step's text on TensorBoard (``asyncrl.observability.samples``)."""
        records = [{"version": version, **s} for s in samples]
        self.samples_log.write(records)
        if records:
            self.loggers.log_text("samples", samples_markdown(records), version)

    def eval(self, record: dict) -> None:
        """An evaluation finished (``asyncrl.tasks.heldout``): the console's before/after, TensorBoard's
        ``eval/exact_match`` at the version it was asked at, the controller's Prometheus gauges."""
        score = record.get("exact_match")
        if score is None:
            return
        if record["label"] == "before":
            self.console.set_eval(before=score)
        elif record["label"] == "after":
            self.console.set_eval(after=score)
        if record["label"] in ("before", "after") and record.get("samples_k"):
            k = record["samples_k"]
            figures = [(f"mean@{k}", record.get("mean_at_k")), (f"pass@{k}", record.get("pass_at_k"))]
            self.console.set_eval_sampled(
                record["label"], " ".join(f"{name} [bold]{v:.3f}[/]" for name, v in figures if v is not None)
            )
        EVAL_EXACT_MATCH.set(score)
        EVAL_VERSION.set(record["version"])
        if record["label"] not in ("before", "after"):  # those two: with the summary (log_summary)
            self.loggers.log_scalars({"eval/exact_match": score}, record["version"])
        # The other figures (asyncrl.tasks.eval_metrics) at every round: eval/NAME, each task of a
        # mix eval/NAME/TASK, each evaluation set eval/SET/NAME.
        scalars = {f"eval/{k}": record[k] for k in EVAL_SCALARS if k != "exact_match" and record.get(k) is not None}
        for task, figures in (record.get("by_task") or {}).items():
            scalars.update({f"eval/{k}/{task}": figures[k] for k in EVAL_SCALARS if figures.get(k) is not None})
        for name, figures in (record.get("sets") or {}).items():
            scalars.update({f"eval/{name}/{k}": figures[k] for k in EVAL_SCALARS if figures.get(k) is not None})
        if scalars:
            self.loggers.log_scalars(scalars, record["version"])

    def close(self, summary: dict | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if summary is not None:
                self.loggers.log_summary(summary)
        finally:
            self.loggers.close()
            self.console.close(summary)
            write_metrics_snapshot(self.run_dir, "controller")
            stop_metrics("controller")
