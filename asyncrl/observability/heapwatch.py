"""Where a process's memory grows: Python allocations by source line, beside resident memory.

Off by default. ``ASYNCRL_HEAPWATCH=SECONDS`` in a component's environment (components inherit
the controller's) makes ``asyncrl.fleet.child`` start ``tracemalloc`` and, every SECONDS, log to
the process's log its RSS, the Python heap ``tracemalloc`` traces, and the 20 source lines whose
traced bytes grew most since the first report (which comes one interval in, past most of
start-up), beside the C allocator's own count (``mallinfo2``: live blocks, free blocks its arenas
keep, blocks mapped apart). RSS that climbs while the traced heap stays level is native memory,
not Python objects: live blocks that climb are native allocations kept (torch's CPU tensors are
such blocks), free blocks that climb are the allocator's fragmentation; a traced heap that
climbs names its lines.
``tracemalloc`` slows allocation-heavy code by tens of percent and its own bookkeeping is
resident too: a diagnostic for soaks, not for runs whose speed is measured.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import tracemalloc

log = logging.getLogger(__name__)
ENV = "ASYNCRL_HEAPWATCH"
TOP = 20
MiB = 1 << 20


def rss_mib() -> float:
    """This process's resident set in MiB (``/proc/self/statm``), or NaN off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB
    except OSError:
        return float("nan")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _load_mallinfo2()


def malloc_mib() -> dict[str, float]:
    """The C allocator's view (glibc ``mallinfo2``) in MiB: ``in_use`` (live ``malloc`` blocks,
    torch's CPU tensors among them, which ``tracemalloc`` does not see), ``free`` (freed blocks
    the arenas keep: fragmentation, what ``malloc_trim`` may give back) and ``mmapped`` (large
    blocks mapped apart). Empty where the C library has no ``mallinfo2``."""
    if _MALLINFO2 is None:
        return {}
    info = _MALLINFO2()
    return {"in_use": info.uordblks / MiB, "free": info.fordblks / MiB, "mmapped": info.hblkhd / MiB}


def describe_malloc() -> str:
    m = malloc_mib()
    if not m:
        return "malloc: no mallinfo2"
    return f"malloc in use {m['in_use']:.1f} MiB, free in arenas {m['free']:.1f} MiB, mmapped {m['mmapped']:.1f} MiB"


class HeapWatch:
    """Logs, every ``interval`` seconds from a daemon thread, RSS and the traced heap's growth by line."""

    def __init__(self, name: str, interval: float):
        if not interval > 0:
            raise ValueError(f"interval ({interval}) must be > 0 seconds")
        self.name = name
        self.interval = interval
        self.reports = 0
        """Reports logged after the reference one (for tests)."""
        self._first: tracemalloc.Snapshot | None = None
        self._first_rss = self._first_traced = 0.0
        self._stop = threading.Event()
        tracemalloc.start(1)
        self._thread = threading.Thread(target=self._run, name=f"{name}.heapwatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.report()

    def report(self) -> None:
        """Log RSS and the traced heap; after the first call, the lines that grew most since it."""
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        traced = tracemalloc.get_traced_memory()[0] / MiB
        rss = rss_mib()
        if self._first is None:
            self._first, self._first_rss, self._first_traced = snap, rss, traced
            log.info(
                "%s heapwatch: rss %.1f MiB, traced %.1f MiB, %s (reference)", self.name, rss, traced, describe_malloc()
            )
            return
        growth = [
            f"  {d.size_diff / 1024:+.1f} KiB {d.count_diff:+d} blocks  {d.traceback[0].filename}:{d.traceback[0].lineno}"
            for d in snap.compare_to(self._first, "lineno")[:TOP]
        ]
        log.info(
            "%s heapwatch: rss %.1f MiB (%+.1f), traced %.1f MiB (%+.1f) since the reference, %s; grew most:\n%s",
            self.name,
            rss,
            rss - self._first_rss,
            traced,
            traced - self._first_traced,
            describe_malloc(),
            "\n".join(growth),
        )
        self.reports += 1

    def stop(self, timeout: float = 10.0) -> None:
        """Stop reporting (waits up to ``timeout`` s for a report in progress) and stop tracing."""
        self._stop.set()
        self._thread.join(timeout)
        tracemalloc.stop()


def start_from_env(name: str) -> HeapWatch | None:
    """A ``HeapWatch`` if ``ASYNCRL_HEAPWATCH`` holds a positive number of seconds; None if unset."""
    raw = os.environ.get(ENV, "")
    if not raw:
        return None
    try:
        interval = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} ({raw!r}) must be a number of seconds") from None
    return HeapWatch(name, interval)
