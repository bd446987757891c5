"""CPU and busy seconds of each component process in a run's steady state, for the benchmarks.

The steady state is the window from the learner's ``start_step``-th step to its last: start-up,
the pipeline fill (the first round of generator calls, which a long run pays once, and the
batches that round stocks at once) and the drained stop are left out, as they are from the
throughput figures. A ``SteadyStateMonitor`` thread beside a
running ``Controller`` reads, at both ends of the window, every fleet process's CPU time (user +
system, from ``/proc/PID/stat``; and the controller's own thread) and its busy seconds (the
``asyncrl_busy_seconds_total`` counter each process already serves on ``/metrics``). Nothing in the
processes' code knows it is being benchmarked; reading /proc costs a few µs per process per
poll, and the two scrapes a millisecond or so per process.

A process adds its busy seconds when a unit of work ends (a generator call, an optimizer step),
so a call that spans an end of the window counts wholly on the side where it ends; over a window
of many calls the two ends roughly cancel. Busy seconds are divided by the time between the two
scrapes of the same process (``busy_window_s_by_role``), not by the steps' window, which the
monitor sees only at its next poll: both then span the same interval, and what is left is that
one call. ``longest_rollout_s_bound`` bounds it: the upper edge of the highest non-empty bucket of
the generators' rollout histogram, so a generator's busy share passes 1 by at most that ÷ window.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_BUSY = re.compile(r"^asyncrl_busy_seconds_total(?:\{[^}]*\})? (\S+)$", re.M)
_ROLLOUT_BUCKET = re.compile(r'^asyncrl_rollout_latency_seconds_bucket\{(?:[^}]*,)?le="([^"]+)"[^}]*\} (\S+)$', re.M)


def cpu_seconds(stat_path: str | Path) -> float | None:
    """User + system CPU seconds from a ``/proc/.../stat`` file; None once it is gone."""
    try:
        text = Path(stat_path).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14 and 15 of stat)


def busy_seconds(exposition: str) -> float:
    """Sum of ``asyncrl_busy_seconds_total`` over its label sets in a Prometheus exposition."""
    return sum(float(v) for v in _BUSY.findall(exposition))


def longest_rollout_bound(exposition: str) -> float:
    """An upper bound on the longest rollout in a Prometheus exposition: the upper edge of the
    lowest bucket of ``asyncrl_rollout_latency_seconds`` that holds every observation (0.0 with
    none; inf when one passed the last finite edge)."""
    buckets = sorted((float(le), float(count)) for le, count in _ROLLOUT_BUCKET.findall(exposition))
    total = buckets[-1][1] if buckets else 0.0
    if total == 0:
        return 0.0
    return next(le for le, count in buckets if count >= total)


class SteadyStateMonitor:
    """Per-process CPU and busy seconds of a controller's fleet from its ``start_step``-th step to its last.

    Used around a controller's run (which needs a whole fleet, so not a doctest)::

        monitor = SteadyStateMonitor(controller).start()
        summary = controller.run(); window = monitor.stop()
        window["cpu_s_by_role"]["buffer"], window["busy_s_by_role"]["generator"]
    """

    def __init__(self, controller, start_step: int = 1, poll_s: float = 0.1):
        if start_step < 1:
            raise ValueError(f"start_step ({start_step}) must be >= 1")
        self.controller = controller
        self.start_step = start_step
        self.poll_s = poll_s
        self.main_tid = threading.main_thread().native_id
        self.last: dict[str, float] = {}  # name -> CPU seconds last read (kept after it exits)
        self.cpu_go: dict[str, float] | None = None
        self.cpu_done: dict[str, float] | None = None
        self.busy_go: dict[str, tuple[float, str]] = {}  # name -> (when it was read, its exposition)
        self.busy_done: dict[str, tuple[float, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-state-monitor", daemon=True)

    def start(self) -> SteadyStateMonitor:
        self._thread.start()
        return self

    def _read_cpu(self) -> None:
        fleet = getattr(self.controller, "fleet", None)
        if fleet is not None:
            for name, proc in list(fleet.procs.items()):
                value = cpu_seconds(f"/proc/{proc.pid}/stat")
                if value is not None:
                    self.last[name] = value
        value = cpu_seconds(f"/proc/self/task/{self.main_tid}/stat")
        if value is not None:
            self.last["controller"] = value

    def _read_busy(self) -> dict[str, tuple[float, str]]:
        """Each live process's exposition, with the middle of the time its scrape took."""
        out = {}
        for port_file in sorted((self.controller.run_dir / "metrics").glob("*.port")):
            url = f"http://127.0.0.1:{port_file.read_text().strip()}/metrics"
            asked = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    text = reply.read().decode()
            except OSError:
                continue  # a process that has gone: the window misses nothing it did after
            out[port_file.stem] = ((asked + time.monotonic()) / 2, text)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_cpu()
            if self.cpu_go is None and self.controller.progress.steps_seen >= self.start_step:
                self.cpu_go = dict(self.last)
                self.busy_go = self._read_busy()
            if self.cpu_done is None and self.controller.progress.done_at:
                self.cpu_done = dict(self.last)
                self.busy_done = self._read_busy()
                return
            time.sleep(self.poll_s)

    def stop(self) -> dict:
        """Stop polling; CPU and busy seconds over the window, by process and summed by role, the
        mean time between each role's two scrapes, and the bound on the longest rollout."""
        self._stop.set()
        self._thread.join(10)
        start, end = self.cpu_go or {}, self.cpu_done or self.last
        roles = dict(getattr(getattr(self.controller, "fleet", None), "roles", {}))
        roles["controller"] = "controller"
        cpu = {n: end[n] - start.get(n, 0.0) for n in end}
        # A process first scraped at the end (started inside the window) counts from zero.
        busy = {
            n: busy_seconds(text) - busy_seconds(self.busy_go.get(n, (0.0, ""))[1])
            for n, (_t, text) in self.busy_done.items()
        }
        spans = {n: t - self.busy_go[n][0] for n, (t, _text) in self.busy_done.items() if n in self.busy_go}
        span_sums, counts = by_role(spans, roles), by_role(dict.fromkeys(spans, 1.0), roles)
        return {
            "cpu_s_by_process": cpu,
            "cpu_s_by_role": by_role(cpu, roles),
            "busy_s_by_process": busy,
            "busy_s_by_role": by_role(busy, roles),
            "busy_window_s_by_role": {role: span_sums[role] / counts[role] for role in span_sums},
            "longest_rollout_s_bound": max(
                (longest_rollout_bound(text) for _t, text in self.busy_done.values()), default=0.0
            ),
        }


def machine_load() -> dict:
    """CPUs and load averages (1, 5, 15 min): on a shared machine, the context of any figure."""
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def by_role(values: dict[str, float], roles: dict[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in values.items():
        role = roles.get(name, name)
        out[role] = out.get(role, 0.0) + value
    return out
