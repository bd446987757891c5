"""Resident memory of the run's processes, read from ``/proc``: each process's peak, the run's total.

Two figures answer two questions. *Peak RSS of a process* (``VmHWM``, the kernel's high-water
mark of its resident set) says which process to shrink; each process reports its own in its
``final`` event (``ProcessContext.emit``), its live descendants added (a vLLM engine core or a
compile worker started by it), so the figure holds whichever launcher started it. *The run's
peak total* (``MemoryWatch``) says whether the machine was big enough: the sum of the
processes' current RSS, sampled by the controller, and the lowest ``MemAvailable`` seen. Both
count pages shared between processes (shared memory weights, the CUDA/torch libraries) once
per process, so the total is an upper bound; ``MemAvailable`` is the machine's own answer.

Off Linux, where there is no ``/proc``, the own process's peak falls back to
``resource.getrusage`` and the rest reads None.
"""

from __future__ import annotations

import os
import resource
import sys
import time

PROC = "/proc"
"""Paths under it are plain strings: ``pathlib`` (up to Python 3.11) interns every part of a
path it builds, so ``Path("/proc") / str(pid)`` interned each process's and thread's number at
every sample, and the interned string died with the path. Each such death leaves a used slot in
CPython's table of interned strings until it is resized: at ~15 a second the controller's table
(~118,000 live strings, mostly the identifiers of the libraries it imports) ran out of free
slots 26 minutes into a soak and doubled (2^18 to 2^19 slots, 3.7 to 7.5 MiB): a step of
resident memory that stays."""


def _status_kib(pid: int, key: str) -> int | None:
    """A ``kB`` line of ``/proc/PID/status`` (``VmHWM``, ``VmRSS``), or None if unreadable."""
    try:
        with open(f"{PROC}/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children of every thread, recursively; empty if unreadable)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"{PROC}/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"{PROC}/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in found:
                    found.append(kid)
                    stack.append(kid)
    return found


def peak_rss_bytes(pid: int | None = None) -> int | None:
    """Peak resident set of ``pid`` (default: this process), in bytes."""
    kib = _status_kib(pid if pid is not None else os.getpid(), "VmHWM")
    if kib is None and pid is None:
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return None if kib is None else kib * 1024


def tree_peak_rss_bytes(pid: int | None = None) -> int | None:
    """Peak RSS of ``pid`` plus that of each of its live descendants (an upper bound of the tree's
    peak: their peaks need not have coincided)."""
    pid = pid if pid is not None else os.getpid()
    own = peak_rss_bytes(pid) if pid != os.getpid() else peak_rss_bytes()
    if own is None:
        return None
    return own + sum(peak_rss_bytes(kid) or 0 for kid in descendants(pid))


def tree_rss_bytes(pid: int) -> int | None:
    """Current RSS of ``pid`` and its live descendants, in bytes (None when ``pid`` is gone)."""
    own = _status_kib(pid, "VmRSS")
    if own is None:
        return None
    return 1024 * (own + sum(_status_kib(kid, "VmRSS") or 0 for kid in descendants(pid)))


def mem_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``: what the machine can still give without swapping."""
    try:
        with open(f"{PROC}/meminfo") as f:
            lines = f.read().splitlines()
        for line in lines:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryWatch:
    """The run's peak total RSS and lowest available memory, sampled at most every ``every_s``.

    >>> watch = MemoryWatch(every_s=1.0)
    >>> watch.sample({"learner": os.getpid()})
    >>> watch.summary()["peak_rss_total_bytes"] > 0
    True
    """

    def __init__(self, every_s: float = 1.0, clock=time.monotonic):
        if every_s <= 0:
            raise ValueError(f"every_s ({every_s}) must be > 0")
        self.every_s = every_s
        self.clock = clock
        self.last = -float("inf")
        self.peak_total: int | None = None
        self.peak_at: dict[str, int] = {}  # each process's RSS at the sample of the peak total
        self.min_available: int | None = None

    def sample(self, pids: dict[str, int], force: bool = False) -> None:
        """Read the RSS of every process in ``pids`` (name -> pid) and the machine's available memory."""
        now = self.clock()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        rss = {name: r for name, pid in pids.items() if (r := tree_rss_bytes(pid)) is not None}
        rss["controller"] = 1024 * (_status_kib(os.getpid(), "VmRSS") or 0)  # itself: its descendants are the others
        total = sum(rss.values())
        if self.peak_total is None or total > self.peak_total:
            self.peak_total, self.peak_at = total, rss
        available = mem_available_bytes()
        if available is not None and (self.min_available is None or available < self.min_available):
            self.min_available = available

    def summary(self) -> dict:
        return {
            "peak_rss_total_bytes": self.peak_total,
            "rss_at_peak_bytes": dict(sorted(self.peak_at.items())),
            "min_mem_available_bytes": self.min_available,
        }
