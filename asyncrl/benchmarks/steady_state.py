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
of many calls the two ends roughly cancel.
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


class SteadyStateMonitor:
    """Per-process CPU and busy seconds of a controller's fleet from its ``start_step``-th step to its last.

    >>> monitor = SteadyStateMonitor(controller).start()  # doctest: +SKIP
    >>> summary = controller.run(); window = monitor.stop()  # doctest: +SKIP
    >>> window["cpu_s_by_role"]["buffer"], window["busy_s_by_role"]["generator"]  # doctest: +SKIP
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
        self.busy_go: dict[str, float] = {}
        self.busy_done: dict[str, float] = {}
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

    def _read_busy(self) -> dict[str, float]:
        out = {}
        for port_file in sorted((self.controller.run_dir / "metrics").glob("*.port")):
            url = f"http://127.0.0.1:{port_file.read_text().strip()}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    out[port_file.stem] = busy_seconds(reply.read().decode())
            except OSError:
                continue  # a process that has gone: the window misses nothing it did after
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
        """Stop polling; CPU and busy seconds over the window, by process and summed by role."""
        self._stop.set()
        self._thread.join(10)
        start, end = self.cpu_go or {}, self.cpu_done or self.last
        roles = dict(getattr(getattr(self.controller, "fleet", None), "roles", {}))
        roles["controller"] = "controller"
        cpu = {n: end[n] - start.get(n, 0.0) for n in end}
        busy = {n: self.busy_done[n] - self.busy_go.get(n, 0.0) for n in self.busy_done}
        return {
            "cpu_s_by_process": cpu,
            "cpu_s_by_role": by_role(cpu, roles),
            "busy_s_by_process": busy,
            "busy_s_by_role": by_role(busy, roles),
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
