"""The suite's sharing of the machine between workers (``tests/scheduling.py``): modules run
longest first with ``alone`` ones ahead, an ``alone`` test waits for the slow tests running and
holds the next ones back, quick tests never wait, and every wait is bounded."""

import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import scheduling

ROOT = Path("/repo")


class Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def iter_markers(self, name):
        return [m for m in self.marks if m.name == name]


def item(module: str, *marks: str, serial: str | None = None) -> Item:
    made = [SimpleNamespace(name=m, args=()) for m in marks]
    if serial:
        made.append(SimpleNamespace(name="serial", args=(serial,)))
    return Item(fspath=str(ROOT / module), marks=made, module=module)


def test_modules_run_alone_ones_first_then_quick_ones_then_longest_first_then_unrecorded(tmp_path):
    record = tmp_path / "durations.txt"
    record.write_text(
        "# header\n  10.00  passed  tests/a.py::t1\n  30.00  passed  tests/b.py::t\n  25.00  passed  tests/a.py::t2\n"
        "   1.00  passed  tests/q.py::t\n"
    )
    seconds = scheduling.recorded_seconds(record)
    assert seconds == {"tests/a.py": 35.0, "tests/b.py": 30.0, "tests/q.py": 1.0}
    items = [
        item("tests/new2.py", "slow"),
        item("tests/b.py", "slow"),
        item("tests/a.py"),
        item("tests/new1.py", "slow"),
        item("tests/q.py"),
        item("tests/r.py", "slow", "alone"),
    ]
    items.insert(3, item("tests/a.py", "slow"))
    ordered = [i.module for i in scheduling.longest_first(items, ROOT, seconds)]
    assert ordered == [
        "tests/r.py",
        "tests/q.py",
        "tests/a.py",
        "tests/a.py",
        "tests/b.py",
        "tests/new2.py",
        "tests/new1.py",
    ]
    assert scheduling.recorded_seconds(tmp_path / "missing.txt") == {}


def hold(test, run_id, entered: threading.Event, release: threading.Event):
    def run():
        with scheduling.machine_share(test, run_id):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_an_alone_test_waits_for_running_slow_tests_and_holds_back_new_ones_but_not_quick_ones():
    run_id = uuid.uuid4().hex
    first_in, first_out = threading.Event(), threading.Event()
    slow = hold(item("tests/s.py", "slow"), run_id, first_in, first_out)
    assert first_in.wait(5)
    alone_in, alone_out = threading.Event(), threading.Event()
    alone = hold(item("tests/r.py", "slow", "alone"), run_id, alone_in, alone_out)
    assert not alone_in.wait(0.5)  # a slow test runs
    later_in, later_out = threading.Event(), threading.Event()
    later = hold(item("tests/t.py", "slow"), run_id, later_in, later_out)
    with scheduling.machine_share(item("tests/q.py"), run_id):  # a quick test: no lock at all
        pass
    first_out.set(), slow.join(5)
    assert alone_in.wait(5) and not later_in.wait(0.5)  # the waiting alone test went first
    alone_out.set(), alone.join(5)
    assert later_in.wait(5)
    later_out.set(), later.join(5)


def test_serial_tests_of_one_name_run_one_at_a_time():
    run_id = uuid.uuid4().hex
    a_in, a_out = threading.Event(), threading.Event()
    a = hold(item("tests/ray1.py", "slow", serial="ray"), run_id, a_in, a_out)
    assert a_in.wait(5)
    b_in, b_out = threading.Event(), threading.Event()
    b = hold(item("tests/ray2.py", "slow", serial="ray"), run_id, b_in, b_out)
    c_in, c_out = threading.Event(), threading.Event()
    c = hold(item("tests/other.py", "slow"), run_id, c_in, c_out)
    assert c_in.wait(5) and not b_in.wait(0.5)
    a_out.set(), a.join(5)
    assert b_in.wait(5)
    b_out.set(), c_out.set(), b.join(5), c.join(5)


def test_a_wait_for_a_lock_is_bounded_and_names_it(monkeypatch):
    monkeypatch.setattr(scheduling, "LOCK_WAIT_S", 0.3)
    run_id = uuid.uuid4().hex
    entered, release = threading.Event(), threading.Event()
    holder = hold(item("tests/r.py", "alone"), run_id, entered, release)
    assert entered.wait(5)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"asyncrl-tests-{run_id}-slow\.lock"):
        with scheduling.machine_share(item("tests/s.py", "slow"), run_id):
            pass
    assert time.monotonic() - started < 5
    release.set(), holder.join(5)


def test_outside_xdist_nothing_is_locked(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert scheduling.xdist_run_id() is None
