"""Hands the C allocator's free memory back to the kernel, every few seconds, in each component.

glibc's ``malloc`` keeps what a process frees in its arenas for reuse and returns it to the
kernel only from the top of the main heap, past ``M_TRIM_THRESHOLD``. A long run's processes
allocate and free megabyte-sized buffers from several threads (msgpack frames, ZeroMQ messages,
vLLM's and torch's host tensors, the tokenizer): freed chunks left below live ones, in the main
heap and in the per-thread arenas, stay resident, and resident memory creeps up for an hour while
the Python heap (``asyncrl.observability.heapwatch``) stays level. ``malloc_trim(0)`` releases
the free pages of every arena (``madvise(MADV_DONTNEED)``), wherever they lie; a daemon thread
calls it every ``run.malloc_trim_s`` seconds. ctypes releases the interpreter lock around the
call, so Python threads run meanwhile; the allocator's threads wait on an arena's lock only
while that arena is trimmed (milliseconds). Where the C library is not glibc (no
``malloc_trim``), nothing is started. Every ``log_every`` trims the process logs the allocator's
state (``asyncrl.observability.heapwatch.describe_malloc``): live blocks that keep climbing are
memory kept, not memory the allocator could give back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

from asyncrl.observability.heapwatch import describe_malloc

log = logging.getLogger(__name__)


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _load_malloc_trim()


def available() -> bool:
    """Whether this process's C library has ``malloc_trim`` (glibc)."""
    return _MALLOC_TRIM is not None


def trim() -> bool:
    """``malloc_trim(0)``: True if it gave memory back, False if none was free (or no glibc)."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


class MallocTrimmer:
    """Calls ``trim`` every ``interval_s`` seconds from a daemon thread until ``stop``."""

    def __init__(self, name: str, interval_s: float, trim_fn: Callable[[], bool] = trim, log_every: int = 20):
        if not interval_s > 0:
            raise ValueError(f"interval_s ({interval_s}) must be > 0 seconds")
        if log_every < 1:
            raise ValueError(f"log_every ({log_every}) must be >= 1")
        self.name = name
        self.interval_s = interval_s
        self.log_every = log_every
        """The allocator's state is logged after the first trim and every ``log_every``-th."""
        self.trims = 0
        """Calls made so far."""
        self.released = 0
        """Calls that gave memory back."""
        self._trim = trim_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}.malloc_trim", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.released += bool(self._trim())
            self.trims += 1
            if self.trims % self.log_every == 1 or self.log_every == 1:
                log.info(
                    "%s: after malloc_trim %d (every %g s): %s",
                    self.name,
                    self.trims,
                    self.interval_s,
                    describe_malloc(),
                )

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread, waiting up to ``timeout`` s for a trim under way."""
        self._stop.set()
        self._thread.join(timeout)


def start(name: str, interval_s: float) -> MallocTrimmer | None:
    """A ``MallocTrimmer`` for this process, or None when ``interval_s`` is 0 (off) or the C
    library is not glibc (logged once)."""
    if interval_s < 0:
        raise ValueError(f"interval_s ({interval_s}) must be >= 0 (0: off)")
    if interval_s == 0:
        return None
    if not available():
        log.info("%s: the C library has no malloc_trim (not glibc); free memory is left to it", name)
        return None
    return MallocTrimmer(name, interval_s)
