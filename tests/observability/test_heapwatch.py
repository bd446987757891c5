import logging

import pytest

from asyncrl.observability import heapwatch
from asyncrl.observability.heapwatch import HeapWatch, start_from_env
from tests.waits import wait_until

kept: list[bytes] = []


def grow() -> None:
    """A line whose allocations stay alive: what the watch must name."""
    kept.extend(bytes(1024) for _ in range(2000))


def test_the_watch_names_the_line_whose_objects_grow(caplog):
    caplog.set_level(logging.INFO, logger=heapwatch.__name__)
    watch = HeapWatch("proc", interval=3600)  # reports only when asked, here
    try:
        watch.report()  # the reference
        grow()
        watch.report()
    finally:
        watch.stop()
        kept.clear()
    reference, report = [r.getMessage() for r in caplog.records]
    assert "(reference)" in reference
    top = report.splitlines()[1]  # the line that grew most comes first
    assert "test_heapwatch.py" in top, report
    assert float(top.split()[0]) >= 2000  # KiB: 2000 blocks of 1 KiB


def test_the_thread_reports_every_interval():
    watch = HeapWatch("proc", interval=0.05)
    try:
        wait_until(lambda: watch.reports >= 2, "two reports after the reference")
    finally:
        watch.stop()


def test_off_unless_the_variable_is_set(monkeypatch):
    monkeypatch.delenv(heapwatch.ENV, raising=False)
    assert start_from_env("proc") is None


@pytest.mark.parametrize("raw", ["soon", "0", "-5"])
def test_a_bad_interval_is_refused_naming_it(monkeypatch, raw):
    monkeypatch.setenv(heapwatch.ENV, raw)
    with pytest.raises(ValueError, match=raw):
        start_from_env("proc")
