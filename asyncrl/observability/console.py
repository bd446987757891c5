"""What ``asyncrl train`` shows while it runs: ``run.console`` = live | plain | quiet | jsonl.

* ``live``: a panel redrawn in place (rich) with the step and a progress bar, reward, accuracy,
  staleness, loss, tokens/s, and one line per process with its state: starting, ready, serving vN
  (a generator), at vN (the learner), restarting, exited (rc), stopped. Falls back to ``plain``
  when stdout is not a terminal (a log file, a CI job). A step that trained multi-turn episodes
  adds a row: turns, tool calls (errors) per episode, and the masked tokens' share (``EPISODE``).
* ``plain``: one line per learner step (with the episode figures when it trained episodes).
* ``quiet``: nothing per step (log lines and the final summary only).
* ``jsonl``: one JSON object per learner step on stdout and nothing else there, for services
  and scripts (``{"type": "step", "version": ..., "reward": ..., "components": {...}}``: the
  step's ``StepStats.record()`` with the rates and the process states).

Accuracy is the held-out exact match when the run evaluated (shown before and after RL) and,
per step, the share of the batch a correctness reward scored right (``accuracy`` in the step's
stats, when such a reward ran). Tokens/s is response tokens trained per second over the last
``WINDOW`` steps.

``update(ev)`` takes every event the controller receives (their ``source``, ``type``, ``role``
and ``version`` set the process states); ``step(stats, t)`` each learner step's ``StepStats``.
The statistics shown are named in ``CELLS``, ``LINE_EXTRAS`` and ``EPISODE``, checked against ``StepStats``
when this module is imported.
"""

from __future__ import annotations

import atexit
import json
import logging
import sys
import time
from collections import deque

from asyncrl.observability.step_stats import StepStats, check_names

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

    def update(self, ev) -> None:
        """Follow one event (``asyncrl.wire.messages.EVENTS``): its ``source``'s new state."""
        name, kind = ev.source, ev.type
        if name is None:
            return
        if kind == "ready":
            self.states[name] = f"serving v{ev.version}" if ev.role == "generator" else "ready"
            if self.fleet is not None:
                self._starts[name] = self.fleet.starts.get(name, 1)
        elif kind == "version":
            self.states[name] = f"serving v{ev.version}"
        elif kind == "step":
            self.states[name] = f"at v{ev.version}"
        elif kind == "done":
            self.states[name] = f"done at v{ev.version}"
        elif ev.final:
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


class StepWindow:
    """The last step's stats and the rates over the last ``WINDOW`` steps."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.last: StepStats | None = None
        self.tokens_per_s: float | None = None
        self.samples_per_s: float | None = None
        self.window: deque[tuple[float, int, int]] = deque(maxlen=WINDOW + 1)
        """(t, tokens, samples) of the last steps."""
        self.eval_before: float | None = None
        self.eval_after: float | None = None
        self.eval_sampled: dict[str, str] = {}
        """Sampled figures of the evaluations before and after RL, by label (``set_eval_sampled``)."""

    def add(self, stats: StepStats, t: float) -> None:
        """Record a step at ``t`` seconds since go; update the rates."""
        self.window.append((t, stats.tokens, stats.samples or 0))
        self.last = stats
        self.tokens_per_s, self.samples_per_s = self.rates()

    def rates(self) -> tuple[float | None, float | None]:
        steps = list(self.window)
        if not steps:
            return None, None
        if len(steps) == 1:
            first_t, counted = 0.0, steps  # the first step: since go
        else:
            first_t, counted = steps[0][0], steps[1:]
        dt = steps[-1][0] - first_t
        if dt <= 0:
            return None, None
        return sum(s[1] for s in counted) / dt, sum(s[2] for s in counted) / dt


LINE_EXTRAS = check_names(("clipfrac", "entropy", "ref_kl"), "console.LINE_EXTRAS")
"""Statistics added to a ``plain`` line when measured."""
_LINE_LABELS = {"clipfrac": ("clip", ".3f"), "entropy": ("H", ".3f"), "ref_kl": ("kl_ref", ".4f")}


def step_line(stats: StepStats, total: int, tokens_per_s: float | None = None) -> str:
    """One learner step as a line of text (the ``plain`` console)."""
    parts = [f"step {stats.version:4d}/{total}", f"loss {stats.loss:+.4f}", f"reward {_fmt(stats.reward, '.3f')}"]
    if stats.accuracy is not None:
        parts.append(f"acc {stats.accuracy:.3f}")
    parts.append(f"staleness {stats.staleness_mean:.2f}/{stats.staleness_max}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:.0f} tok/s")
    parts.append(f"wait {_fmt(stats.wait_s, '.2f')}s step {stats.step_s:.2f}s")
    if stats.is_weight_mean is not None:
        parts.append(f"w {stats.is_weight_mean:.2f}/{_fmt(stats.is_weight_max, '.1f')}")
    for key in LINE_EXTRAS:
        if (value := getattr(stats, key)) is not None:
            label, fmt = _LINE_LABELS[key]
            parts.append(f"{label} {value:{fmt}}")
    parts += [f"{label} {value}" for label, value in episode_cells(stats)]
    return "  ".join(parts)


EPISODE = check_names(
    ("episode_turns", "episode_tool_calls", "episode_tool_errors", "episode_masked_frac"), "console.EPISODE"
)
"""A step's multi-turn figures, shown when it trained episodes (a single-turn run's console is
unchanged): on the ``plain`` line and as a row of the live panel."""


def episode_cells(stats: StepStats | None) -> list[tuple[str, str]]:
    """(label, value) of the ``EPISODE`` figures; none for a step without episodes.

    >>> s = StepStats(version=1, loss=0.0, tokens=8, staleness_mean=0.0, staleness_max=0)
    >>> episode_cells(s)
    []
    >>> s.episode_turns, s.episode_tool_calls, s.episode_tool_errors, s.episode_masked_frac = 2.5, 1.5, 0.5, 0.25
    >>> episode_cells(s)
    [('turns/ep', '2.50'), ('tools/ep', '1.50 (0.50 err)'), ('masked', '25.0%')]
    """
    if stats is None or stats.episode_turns is None:
        return []
    turns, calls, errors, masked = (getattr(stats, key) for key in EPISODE)
    return [
        ("turns/ep", _fmt(turns, ".2f")),
        ("tools/ep", f"{_fmt(calls, '.2f')} ({_fmt(errors, '.2f')} err)"),
        ("masked", _fmt(masked, ".1%")),
    ]


CELLS = (
    ("reward", "reward", ".3f"),
    ("accuracy", "accuracy", ".3f"),
    ("staleness mean", "staleness_mean", ".2f"),
    ("staleness max", "staleness_max", "d"),
    ("loss", "loss", "+.4f"),
)
"""The live panel's statistics: (label, ``StepStats`` field, format), followed by the rates."""
check_names((key for _label, key, _fmt in CELLS), "console.CELLS")


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
        self.steps = StepWindow(total_steps)
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

    def update(self, ev) -> None:
        """Any event: the process states."""
        self.components.update(ev)

    def step(self, stats: StepStats, t: float) -> None:
        """A learner step's stats, ``t`` seconds after go: a line, a JSON object or a redraw."""
        self.steps.add(stats, t)
        if self.mode == "plain":
            print(step_line(stats, self.steps.total_steps, self.steps.tokens_per_s), file=self.out, flush=True)
        elif self.mode == "jsonl":
            rates = {"tokens_per_s": self.steps.tokens_per_s, "samples_per_s": self.steps.samples_per_s}
            record = {"type": "step", **stats.record(), "t": t, **rates, "components": self.components.snapshot()}
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

        window, last = self.steps, self.steps.last
        version = last.version if last is not None else 0
        elapsed = time.monotonic() - self.started
        head = Table.grid(padding=(0, 2))
        head.add_row(
            f"[bold]{self.run_name}[/]",
            f"step {version}/{window.total_steps}",
            ProgressBar(total=max(window.total_steps, 1), completed=version, width=40),
            f"{elapsed:,.0f} s",
        )
        numbers = Table.grid(padding=(0, 3))
        cells = [(label, getattr(last, key) if last is not None else None, fmt) for label, key, fmt in CELLS]
        cells += [("tokens/s", window.tokens_per_s, ",.0f"), ("samples/s", window.samples_per_s, ",.1f")]
        numbers.add_row(*(f"{name} [bold]{_fmt(value, fmt)}[/]" for name, value, fmt in cells))
        episode_row = None
        if episodes := episode_cells(last):  # a grid of its own: the numbers' columns keep their widths
            episode_row = Table.grid(padding=(0, 3))
            episode_row.add_row(*(f"{name} [bold]{value}[/]" for name, value in episodes))
        held_out = []
        if window.eval_before is not None:
            held_out.append(f"held-out exact match before RL [bold]{window.eval_before:.3f}[/]")
        if window.eval_after is not None:
            held_out.append(f"after [bold]{window.eval_after:.3f}[/]")
        for label, text in window.eval_sampled.items():
            held_out.append(f"{label}: {text}")
        procs = Table(box=None, show_header=False, padding=(0, 2))
        snapshot = self.components.snapshot()
        for name in sorted(snapshot):
            state = snapshot[name]
            style = "red" if state.startswith(("exited", "failed", "restarting")) else "green"
            procs.add_row(name, f"[{style}]{state}[/]")
        parts = [
            head,
            numbers,
            *([episode_row] if episode_row else []),
            *([" ".join(held_out)] if held_out else []),
            procs,
        ]
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
