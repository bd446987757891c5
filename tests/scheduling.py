"""How the suite shares one machine between its workers (``make test`` runs ``pytest -n 2``).

Two rules, both held by ``flock`` on files named for the run, so they span the workers:

- A test marked ``alone`` (the 0.5 B rehearsal: ~17 GB resident, and it asserts that the machine
  kept 3 GiB free) runs beside no other test marked ``slow``; tests not marked ``slow`` (no real
  processes, little memory) may still run beside it. Every slow test holds the ``slow`` lock
  shared; an ``alone`` one holds it exclusive. A turnstile lock keeps an ``alone`` test that is
  waiting from being overtaken by the next shared holder.
- Tests marked ``serial("NAME")`` run one at a time among those naming NAME (``ray``: local Ray
  clusters, whose head processes and session folders are not meant to share a machine).

The order: pytest-xdist hands out whole modules (``--dist loadscope``: a module's fixtures, such
as a running engine, are built once) in the order collected: ``alone`` modules first, then the
modules without a slow test (the other worker runs them beside the ``alone`` ones, which leave no
room for a slow test), then the rest longest first by ``tests/durations.txt``, the modules the
record lacks after those measured.

Outside pytest-xdist (``pytest -p no:xdist``, or ``-n 0``) no lock is taken and the order is the
same. Each wait is bounded by ``LOCK_WAIT_S`` and fails naming the lock it waited for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.txt")

LOCK_WAIT_S = 3600.0
"""Seconds a test may wait for a lock: longer than any one test holds one (the rehearsal is
bounded by 1,920 s in ``tests/integration/test_rehearsal.py``), shorter than the CI job."""


def recorded_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds of each module in the durations record (its tests summed); empty if it is missing."""
    per_module: dict[str, float] = {}
    if not path.exists():
        return per_module
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        seconds, _outcome, test = line.split(maxsplit=2)
        module = test.split("::", 1)[0]
        per_module[module] = per_module.get(module, 0.0) + float(seconds)
    return per_module


def longest_first(items: list, root: Path, seconds: dict[str, float]) -> list:
    """``items`` grouped by module: modules holding an ``alone`` test first, then those without a
    slow test, then by recorded seconds, longest first; within each, modules the record lacks keep
    their collected order after those measured."""
    order: dict[str, int] = {}
    alone: set[str] = set()
    slow: set[str] = set()
    for item in items:
        module = module_of(item, root)
        order.setdefault(module, len(order))
        if item.get_closest_marker("alone") is not None:
            alone.add(module)
        if item.get_closest_marker("slow") is not None:
            slow.add(module)

    def key(module: str) -> tuple:
        tier = 0 if module in alone else 1 if module not in slow else 2
        return (tier, module not in seconds, -seconds.get(module, 0.0), order[module])

    rank = {module: i for i, module in enumerate(sorted(order, key=key))}
    return sorted(items, key=lambda item: rank[module_of(item, root)])  # stable within a module


def module_of(item, root: Path) -> str:
    return str(Path(item.fspath).relative_to(root)) if Path(item.fspath).is_relative_to(root) else str(item.fspath)


@contextlib.contextmanager
def machine_share(item, run_id: str | None) -> Iterator[None]:
    """Hold the locks ``item``'s markers ask for while it runs (none outside pytest-xdist)."""
    slow = item.get_closest_marker("slow") is not None
    alone = item.get_closest_marker("alone") is not None
    serial = [m.args[0] for m in item.iter_markers("serial")]
    if run_id is None or not (slow or alone or serial):
        yield
        return
    with contextlib.ExitStack() as held:
        if alone or slow:
            if alone:
                gate = held.enter_context(locked(run_id, "gate", fcntl.LOCK_EX))
                held.enter_context(locked(run_id, "slow", fcntl.LOCK_EX))
                gate.close()  # the machine is ours: the others may queue again
            else:
                with locked(run_id, "gate", fcntl.LOCK_EX):  # not past an alone test that waits
                    pass
                held.enter_context(locked(run_id, "slow", fcntl.LOCK_SH))
        for name in sorted(serial):
            held.enter_context(locked(run_id, f"serial-{name}", fcntl.LOCK_EX))
        yield


@contextlib.contextmanager
def locked(run_id: str, name: str, mode: int) -> Iterator:
    """The lock file ``name`` of this run, held in ``mode``; fails after ``LOCK_WAIT_S``."""
    path = Path(tempfile.gettempdir()) / f"asyncrl-tests-{run_id}-{name}.lock"
    f = open(path, "a+")
    deadline = time.monotonic() + LOCK_WAIT_S
    try:
        while True:
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {LOCK_WAIT_S:.0f} s for the test lock {path}") from None
                time.sleep(0.1)
        yield f
    finally:
        f.close()  # closing releases the lock (a second close is harmless)


def xdist_run_id() -> str | None:
    """The run's id under pytest-xdist (shared by its workers), else None."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") if os.environ.get("PYTEST_XDIST_WORKER") else None
