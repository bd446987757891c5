"""Held-out evaluation as the controller runs it: rounds by the generators' engines
(``asyncrl.tasks.heldout``) at start, every ``eval.every_versions`` versions and at the end, and
the record of each in ``evals.jsonl``. A round before or after RL blocks the run (its seconds
are kept apart from the RL wall time); a periodic one runs beside training. A periodic round that
falls due while another round runs (the overlapped round before RL, or a slow periodic one) waits
for it; only the latest such round waits, so a slow round delays the curve's points but cannot
pile them up, and the round after RL supersedes one still waiting.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.observability.progress import RunProgress
from asyncrl.tasks.eval_sets import MAIN_SET
from asyncrl.tasks.heldout import EvalConfig, HeldOutEvaluator

log = logging.getLogger("asyncrl")

NextEvent = Callable[..., "dict | None"]
"""``EventPump.next``: waits for and routes the next event."""


class Evaluations:
    """Owns the evaluator (None: the generators do not evaluate), every round's record, the
    scores before and after RL, and the seconds the run stood still for them."""

    def __init__(
        self,
        cfg: EvalConfig,
        total_steps: int,
        run_dir: Path,
        console: RunProgress,
        heldout: HeldOutEvaluator | None,
        before: float | None = None,
    ):
        self.cfg = cfg
        self.total_steps = total_steps
        self.run_dir = run_dir
        self.console = console
        self.heldout = heldout
        self.before = before
        self.after: float | None = None
        self.records: list[dict] = []
        self.blocking_s = 0.0
        """Seconds the RL phase stood still for ``before`` / ``after``."""
        self.on_before: Callable[[dict], None] | None = None
        """Called with the ``before`` round's record when it ends (scored or failed)."""
        self.waiting: tuple[str, int] | None = None
        """(label, version) of the periodic round that fell due while another ran."""

    def poll(self, num_generators: int) -> None:
        """Offer requests and time out late ones (a duty of the event loop)."""
        if self.heldout is not None:
            self._record(self.heldout.poll(num_generators))

    def answer(self, body: dict) -> None:
        """A generator's ``eval_result``."""
        if self.heldout is not None:
            self._record(self.heldout.answer(body))

    def on_step(self, version: int) -> None:
        """Start the periodic round a learner step makes due (the last step's is ``after``)."""
        every = self.cfg.every_versions
        if self.heldout is not None and every and version % every == 0 and version < self.total_steps:
            if self.heldout.current is None:
                self.heldout.start(f"v{version}", version)
                return
            if self.waiting is not None:
                log.warning("eval %s skipped: eval v%d falls due while it waits", self.waiting[0], version)
            log.info("eval v%d waits for eval %s to finish", version, self.heldout.current.label)
            self.waiting = (f"v{version}", version)

    def start_before(self, num_generators: int) -> float:
        """Open the ``before`` round without waiting for it (``eval.overlap_before``); returns its
        bound in seconds (``HeldOutEvaluator.round_bound_s``), the longest the generators hold
        their starting weights for it."""
        self.heldout.start("before", 0)
        return self.heldout.round_bound_s(num_generators)

    def run_round(self, label: str, version: int, next_event: NextEvent) -> dict:
        """Run an evaluation round to its end (each request bounded by its timeout, so the wait
        is too) and return its record; a periodic round still running is let finish first."""
        start = time.monotonic()
        if self.waiting is not None:
            log.info("eval %s skipped: eval %s supersedes it", self.waiting[0], label)
            self.waiting = None
        while self.heldout.current is not None:
            next_event(None, f"eval {self.heldout.current.label} to finish before eval {label}")
        self.heldout.start(label, version)
        done = len(self.records)
        while len(self.records) == done:
            next_event(None, f"the generators' answers to eval {label}", wait=0.2)
        self.blocking_s += time.monotonic() - start
        return self.records[-1]

    def _record(self, record: dict | None) -> None:
        if record is None:
            return
        self.records.append(record)
        if record["label"] == "before":
            self.before = record["exact_match"]
            if self.on_before is not None:
                self.on_before(record)
        with open(self.run_dir / "evals.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.console.eval(record)
        if record["exact_match"] is not None:
            log.info(
                "held-out %s (version %d, served %s, %d prompts, %.1f s): %s",
                record["label"],
                record["version"],
                record["versions"],
                record["num_prompts"],
                record["wall_s"],
                describe(record),
            )
            for name, figures in (record.get("sets") or {}).items():
                if name != MAIN_SET and figures["exact_match"] is not None:
                    log.info(
                        "held-out %s, set %s (%d prompts): %s",
                        record["label"],
                        name,
                        figures["num_prompts"],
                        describe(figures),
                    )
        if self.waiting is not None:  # the round it waited for has ended
            self.heldout.start(*self.waiting)
            self.waiting = None


def describe(figures: dict) -> str:
    """One line of a round's (or a set's) figures: greedy accuracy, completed correctness, mean@k,
    pass@k, and, for prompts played as episodes, the greedy episodes' turns and tool calls and
    the environment's failures.

    >>> describe({"exact_match": 0.5, "completed": 0.75, "completed_accuracy": 0.6667})
    'greedy 0.500 (completed 0.750, correct of those 0.667)'
    >>> played = {"episode_turns": 2.5, "episode_tool_calls": 1.25, "episode_tool_errors": 0.5, "env_failures": 1}
    >>> describe({"exact_match": 0.5, "completed": 1.0, "completed_accuracy": 0.5, **played})
    'greedy 0.500 (completed 1.000, correct of those 0.500); episodes: 2.50 turns, 1.25 tool calls (0.50 errors), 1 failed by the environment'
    """

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    line = (
        f"greedy {share(figures['exact_match'])} (completed {share(figures['completed'])}, "
        f"correct of those {share(figures['completed_accuracy'])})"
    )
    k = figures.get("samples_k")
    if k:
        line += (
            f", sampled k={k}: mean@k {share(figures['mean_at_k'])}, pass@k {share(figures['pass_at_k'])} "
            f"(completed {share(figures['sampled_completed'])}, correct of those "
            f"{share(figures['sampled_completed_accuracy'])})"
        )
    if "env_failures" in figures:  # played as episodes

        def mean(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.2f}"

        line += (
            f"; episodes: {mean(figures['episode_turns'])} turns, {mean(figures['episode_tool_calls'])} tool calls "
            f"({mean(figures['episode_tool_errors'])} errors), {figures['env_failures']} failed by the environment"
        )
    return line
