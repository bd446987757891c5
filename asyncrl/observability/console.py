"""What ``asyncrl train`` shows while it runs: ``run.console`` = live | plain | quiet | jsonl.

* ``live``: a panel redrawn in place (rich) with the step and a progress bar, reward, accuracy,
  staleness, tokens/s, and one line per process with its state: starting, ready, serving vN
  (a generator), at vN (the learner), restarting, exited (rc), stopped. Falls back to ``plain``
  when stdout is not a terminal (a log file, a CI job).
* ``plain``: one line per learner step.
* ``quiet``: nothing per step (log lines and the final summary only).
* ``jsonl``: one JSON object per learner step on stdout and nothing else there, for services
  and scripts (``{"type": "step", "version": ..., "reward": ..., "components": {...}}``).

Accuracy is the held-out exact match when the run evaluated (shown before and after RL) and,
per step, the share of the batch a correctness reward scored right (``accuracy`` in the step
event, when such a reward ran). Tokens/s is response tokens trained per second over the last
``WINDOW`` steps.
"""

from __future__ import annotations

import atexit
import json
import logging
import sys
import time
from collections import deque

WINDOW = 10
"""Steps over which tokens/s and samples/s are averaged."""

MODES = ("live", "plain", "quiet", "jsonl")

_output = None  # where progress goes when not given; None: sys.stdout at the time
_last_mode = "plain"  # the mode of the last console made: print_summary follows it


def set_output(stream) -> None:
    """Send progress to ``stream`` (``asyncrl train`` in jsonl mode points everything else at
    stderr and keeps the real stdout for the JSON lines)."""
    global _output
    _output = stream


class ComponentStates:
    """Each process's state, from its events and, when watched, from the fleet's processes."""

    def __init__(self):
        self.states: dict[str, str] = {}
        self.fleet = None
        self._starts: dict[str, int] = {}

    def update(self, ev: dict) -> None:
        name, kind = ev.get("source"), ev.get("type")
        if name is None:
            return
        if kind == "ready":
            self.states[name] = f"serving v{ev['version']}" if ev.get("role") == "generator" else "ready"
            if self.fleet is not None:
                self._starts[name] = self.fleet.starts.get(name, 1)
        elif kind == "version":
            self.states[name] = f"serving v{ev['version']}"
        elif kind == "step":
            self.states[name] = f"at v{ev['version']}"
        elif kind == "done":
            self.states[name] = f"done at v{ev['version']}"
        elif kind == "final":
            self.states[name] = "stopped"
        elif kind == "error":
            self.states[name] = "failed"

    def set(self, name: str, state: str) -> None:
        """Say what a process is doing when no event of its own says it (e.g. 'restarting')."""
        self.states[name] = state

    def snapshot(self) -> dict[str, str]:
        """name -> state. A process started again since its last "ready" is restarting; one that
        exited without its final report shows its exit code. Reads only what the controller's
        thread already observed (no syscalls: the live view redraws from its own thread)."""
        out = dict(self.states)
        if self.fleet is None:
            return out
        for name, proc in list(self.fleet.procs.items()):
            state = out.get(name, "starting")
            if self.fleet.starts.get(name, 1) > self._starts.get(name, 1) and not state.startswith("restarting"):
                state = "restarting"
            elif proc.returncode not in (None, 0) and state != "stopped":
                state = f"exited ({proc.returncode})"
            out[name] = state
        return out


class StepStats:
    """The last step's numbers and the windowed rates derived from the steps seen."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.last: dict | None = None
        self.window: deque[dict] = deque(maxlen=WINDOW + 1)
        self.eval_before: float | None = None
        self.eval_after: float | None = None
        self.eval_sampled: dict[str, str] = {}
        """Sampled figures of the evaluations before and after RL, by label (``set_eval_sampled``)."""

    def add(self, ev: dict) -> dict:
        """Record a step event; return its row: the event's numbers plus tokens/s and samples/s."""
        self.window.append(ev)
        row = dict(ev)
        row["tokens_per_s"], row["samples_per_s"] = self.rates()
        self.last = row
        return row

    def rates(self) -> tuple[float | None, float | None]:
        steps = list(self.window)
        if not steps or "t" not in steps[-1]:
            return None, None
        if len(steps) == 1:
            first_t, counted = 0.0, steps  # the first step: since go
        else:
            first_t, counted = steps[0]["t"], steps[1:]
        dt = steps[-1]["t"] - first_t
        if dt <= 0:
            return None, None
        tokens = sum(s.get("tokens", 0) for s in counted)
        samples = sum(s.get("samples", 0) for s in counted)
        return (tokens / dt if any("tokens" in s for s in counted) else None), samples / dt


def step_line(row: dict, total: int) -> str:
    """One learner step as a line of text (the ``plain`` console)."""
    parts = [f"step {row['version']:4d}/{total}", f"loss {row['loss']:+.4f}", f"reward {row['reward']:.3f}"]
    if row.get("accuracy") is not None:
        parts.append(f"acc {row['accuracy']:.3f}")
    parts.append(f"staleness {row['staleness_mean']:.2f}/{row['staleness_max']}")
    if row.get("tokens_per_s") is not None:
        parts.append(f"{row['tokens_per_s']:.0f} tok/s")
    parts.append(f"wait {row['wait_s']:.2f}s step {row['step_s']:.2f}s")
    if "is_weight_mean" in row:
        parts.append(f"w {row['is_weight_mean']:.2f}/{row['is_weight_max']:.1f}")
    for key, label, fmt in (("clipfrac", "clip", ".3f"), ("entropy", "H", ".3f"), ("ref_kl", "kl_ref", ".4f")):
        if key in row:
            parts.append(f"{label} {row[key]:{fmt}}")
    return "  ".join(parts)


class RunConsole:
    """The console of one run in one of ``MODES``; ``update`` takes every controller event."""

    def __init__(self, mode: str, total_steps: int, run_name: str = "run", out=None):
        if mode not in MODES:
            raise ValueError(f"run.console ({mode!r}) must be one of {MODES}")
        global _last_mode
        _last_mode = mode
        self.out = out if out is not None else (_output or sys.stdout)
        self._stdout = None
        if mode == "jsonl" and self.out is sys.stdout:
            # Stray prints (SFT progress, libraries) go to stderr: stdout holds JSON lines only.
            self._stdout, sys.stdout = sys.stdout, sys.stderr
        if mode == "live" and not (hasattr(self.out, "isatty") and self.out.isatty()):
            mode = "plain"  # nothing to redraw in a file or a pipe
        self.mode = mode
        self.run_name = run_name
        self.components = ComponentStates()
        self.steps = StepStats(total_steps)
        self.started = time.monotonic()
        self.live = None
        self._handlers: list[tuple[logging.StreamHandler, object]] = []
        if mode == "live":
            self._start_live()
        if self.live is not None or self._stdout is not None:
            atexit.register(self.close)  # a run that fails before its end still gives the terminal back

    def watch(self, fleet) -> None:
        """Derive restarts and exits from the fleet's processes as well as from events."""
        self.components.fleet = fleet

    def update(self, ev: dict) -> None:
        self.components.update(ev)
        if ev.get("type") != "step":
            return
        row = self.steps.add(ev)
        if self.mode == "plain":
            print(step_line(row, self.steps.total_steps), file=self.out, flush=True)
        elif self.mode == "jsonl":
            record = {"type": "step", **row, "components": self.components.snapshot()}
            print(json.dumps(record), file=self.out, flush=True)
        elif self.live is not None:
            self.live.refresh()

    def set_eval(self, before: float | None = None, after: float | None = None) -> None:
        if before is not None:
            self.steps.eval_before = before
        if after is not None:
            self.steps.eval_after = after

    def set_eval_sampled(self, label: str, text: str) -> None:
        """The sampled figures (mean@k, pass@k) of the evaluation ``label`` (``before``, ``after``)."""
        self.steps.eval_sampled[label] = text

    def close(self, summary: dict | None = None) -> None:
        if summary is not None:
            self.set_eval(summary.get("eval_before"), summary.get("eval_after"))
        if self._stdout is not None:
            sys.stdout, self._stdout = self._stdout, None
        if self.live is not None:
            self.live.refresh()
            self.live.stop()
            self.live = None
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._handlers = []

    # -- live view --------------------------------------------------------------------------------

    def _start_live(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.live = Live(
            get_renderable=self.render,
            console=Console(file=self.out),
            refresh_per_second=2,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self.live.start()
        # Log lines go above the panel instead of through it: point the root logger's stream
        # handlers at the (now redirected) stderr, and back at close.
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.__stderr__, sys.__stdout__):
                previous = handler.setStream(sys.stderr)  # None when stderr was not redirected
                if previous is not None:
                    self._handlers.append((handler, previous))

    def render(self):
        """The live panel: a header with the progress bar, the last step's numbers, the processes."""
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        stats, row = self.steps, self.steps.last or {}
        version = row.get("version", 0)
        elapsed = time.monotonic() - self.started
        head = Table.grid(padding=(0, 2))
        head.add_row(
            f"[bold]{self.run_name}[/]",
            f"step {version}/{stats.total_steps}",
            ProgressBar(total=max(stats.total_steps, 1), completed=version, width=40),
            f"{elapsed:,.0f} s",
        )
        numbers = Table.grid(padding=(0, 3))
        cells = [
            ("reward", row.get("reward"), ".3f"),
            ("accuracy", row.get("accuracy"), ".3f"),
            ("staleness mean", row.get("staleness_mean"), ".2f"),
            ("staleness max", row.get("staleness_max"), "d"),
            ("tokens/s", row.get("tokens_per_s"), ",.0f"),
            ("samples/s", row.get("samples_per_s"), ",.1f"),
            ("loss", row.get("loss"), "+.4f"),
        ]
        numbers.add_row(*(f"{name} [bold]{_fmt(value, fmt)}[/]" for name, value, fmt in cells))
        held_out = []
        if stats.eval_before is not None:
            held_out.append(f"held-out exact match before RL [bold]{stats.eval_before:.3f}[/]")
        if stats.eval_after is not None:
            held_out.append(f"after [bold]{stats.eval_after:.3f}[/]")
        for label, text in stats.eval_sampled.items():
            held_out.append(f"{label}: {text}")
        procs = Table(box=None, show_header=False, padding=(0, 2))
        snapshot = self.components.snapshot()
        for name in sorted(snapshot):
            state = snapshot[name]
            style = "red" if state.startswith(("exited", "failed", "restarting")) else "green"
            procs.add_row(name, f"[{style}]{state}[/]")
        parts = [head, numbers, *([" ".join(held_out)] if held_out else []), procs]
        return Panel(Group(*parts), title="asyncrl", border_style="blue")


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def print_summary(summary: dict, out=None) -> None:
    """The run's summary at the end of ``asyncrl train``, in the console's mode: indented JSON
    (live, plain), one ``{"type": "summary", ...}`` line (jsonl), nothing (quiet; it is in
    RUN_DIR/summary.json either way)."""
    out = out if out is not None else (_output or sys.stdout)
    if _last_mode == "quiet":
        return
    if _last_mode == "jsonl":
        print(json.dumps({"type": "summary", **summary}), file=out, flush=True)
    else:
        print(json.dumps(summary, indent=2), file=out, flush=True)
