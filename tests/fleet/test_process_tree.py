"""No orphans, with plain processes standing in for components (``asyncrl.fleet.process_tree``):
a killed component's group goes down with it (the fleet's kill), a component's forked child ends
the group when the component dies (nobody else left), a component ends its group when the
controller dies, and a watch never ends a group that is not its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.fleet import process_tree
from asyncrl.fleet.local import ProcessFleet

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
SPAWNS_A_SLEEPER = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print('grandchild', c.pid, flush=True); time.sleep(600)"
)
FORKS_A_SLEEPER = (
    "import multiprocessing, time; from asyncrl.fleet import process_tree; process_tree.arm_children(); "
    "p = multiprocessing.get_context('fork').Process(target=time.sleep, args=(600,)); p.start(); "
    "print('grandchild', p.pid, flush=True); time.sleep(600)"
)


def read_pid(stream, tag: str, timeout: float = 20) -> int:
    """The PID a stand-in printed as ``tag PID`` (bounded: a stand-in that never prints fails the test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if line.startswith(tag + " "):
            return int(line.split()[1])
        if not line:
            time.sleep(0.05)
    raise TimeoutError(f"no '{tag} PID' line within {timeout} s")


def gone_within(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for every one of ``pids`` to be gone; those still alive."""
    deadline = time.monotonic() + timeout
    while process_tree.alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return process_tree.alive(pids)


def start(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **kwargs)


def end(*pids: int) -> None:
    """Kill what a failed test left, by PID."""
    for pid in process_tree.alive(list(pids)):
        os.kill(pid, signal.SIGKILL)


def test_killing_a_components_group_takes_its_grandchildren():
    parent = start(SPAWNS_A_SLEEPER, **process_tree.popen_kwargs())
    grandchild = read_pid(parent.stdout, "grandchild")
    try:
        assert os.getpgid(parent.pid) == parent.pid and os.getpgid(grandchild) == parent.pid
        os.kill(parent.pid, signal.SIGKILL)
        assert process_tree.wait_unreaped(parent.pid, 10)
        assert process_tree.alive([grandchild]) == [grandchild]  # an orphan: nothing in it watches
        assert process_tree.kill_group(parent.pid)
        parent.wait(10)
        assert gone_within([grandchild], 5) == []
    finally:
        end(grandchild)


def test_a_forked_child_ends_the_group_when_its_parent_dies():
    parent = start(FORKS_A_SLEEPER, **process_tree.popen_kwargs())
    grandchild = read_pid(parent.stdout, "grandchild")
    try:
        os.kill(parent.pid, signal.SIGKILL)  # and nobody kills the group: the child's watch does
        assert gone_within([grandchild], 5) == []
        parent.wait(10)
    finally:
        end(grandchild)


def test_a_forked_child_whose_parent_died_before_it_first_ran_ends_the_group():
    """Under load a child may first run after its parent is gone: it must still know its parent."""
    slow_start = "import os, time; os.register_at_fork(after_in_child=lambda: time.sleep(2)); "  # runs first
    parent = start(slow_start + FORKS_A_SLEEPER, **process_tree.popen_kwargs())
    grandchild = read_pid(parent.stdout, "grandchild")
    try:
        os.kill(parent.pid, signal.SIGKILL)  # while the child still sleeps in its first handler
        assert gone_within([grandchild], 10) == []
        parent.wait(10)
    finally:
        end(grandchild)


def test_a_component_ends_its_group_when_the_controller_dies():
    component = f"from asyncrl.fleet import process_tree; process_tree.guard_component(); {SPAWNS_A_SLEEPER}"
    controller = start(
        "import os, subprocess, sys, time; from asyncrl.fleet import process_tree; "
        f"c = subprocess.Popen([sys.executable, '-c', {component!r}], "
        "env={**os.environ, process_tree.PARENT_ENV: str(os.getpid())}, **process_tree.popen_kwargs()); "
        "print('component', c.pid, flush=True); time.sleep(600)"
    )
    pid = read_pid(controller.stdout, "component")
    grandchild = read_pid(controller.stdout, "grandchild")
    try:
        assert process_tree.alive([pid, grandchild]) == sorted([pid, grandchild])
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(10)
        assert gone_within([pid, grandchild], 5) == []
    finally:
        end(pid, grandchild)


def test_a_component_whose_controller_died_before_its_watch_ends_at_once():
    code = "from asyncrl.fleet import process_tree; process_tree.guard_component(); import time; time.sleep(600)"
    # PARENT_ENV names a process that is not this one's parent: as if the controller died first.
    proc = start(code, env={**os.environ, process_tree.PARENT_ENV: "999999999"}, **process_tree.popen_kwargs())
    try:
        assert proc.wait(20) == -signal.SIGKILL
    finally:
        end(proc.pid)


def test_a_watch_ends_only_its_own_process_in_a_group_it_does_not_own():
    # A leads the group; B is A's child, C is B's child watching B. B dies: C's group is A's, which
    # is neither C's nor B's, so C ends itself alone and A lives on.
    c_code = "from asyncrl.fleet import process_tree; process_tree.watch_parent(); import time; time.sleep(600)"
    b_code = (
        f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {c_code!r}]); "
        "print('c', c.pid, flush=True); time.sleep(600)"
    )
    a = start(
        f"import subprocess, sys, time; b = subprocess.Popen([sys.executable, '-c', {b_code!r}]); "
        "print('b', b.pid, flush=True); time.sleep(600)",
        **process_tree.popen_kwargs(),
    )
    b = read_pid(a.stdout, "b")
    c = read_pid(a.stdout, "c")
    try:
        time.sleep(0.5)  # C's watch has begun (it imports asyncrl first)
        os.kill(b, signal.SIGKILL)
        assert gone_within([c], 5) == []
        assert a.poll() is None
    finally:
        process_tree.kill_group(a.pid)
        a.wait(10)
        end(b, c)


class StandInFleet(ProcessFleet):
    """A fleet whose components are stand-ins that start one sleeping child each."""

    def command(self, role: str, name: str) -> list[str]:
        return [sys.executable, "-c", SPAWNS_A_SLEEPER]


def started_grandchild(fleet: StandInFleet, name: str, before: int | None = None, timeout: float = 20) -> int:
    """The child that component ``name`` started last (other than ``before``: a restart appends to the log)."""
    log = fleet.run_dir / "logs" / f"{name}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("grandchild ")]
        if pids and pids[-1] != before:
            return pids[-1]
        time.sleep(0.05)
    raise TimeoutError(f"{name} started no new child within {timeout} s")


def test_the_fleet_kills_the_group_of_a_component_found_dead_and_of_every_one_it_stops(tmp_path):
    fleet = StandInFleet(tmp_path, tmp_path, dict(os.environ))
    fleet.start("generator", "generator-0")
    fleet.start("reward", "reward-0")
    restarted = None
    killed, stopped = started_grandchild(fleet, "generator-0"), started_grandchild(fleet, "reward-0")
    try:
        os.kill(fleet.pid("generator-0"), signal.SIGKILL)  # as the OOM killer or the chaos bench would
        deadline = time.monotonic() + 10
        while not fleet.dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fleet.dead() == {"generator-0": -signal.SIGKILL}
        assert gone_within([killed], 5) == []
        fleet.restart("generator-0")
        restarted = started_grandchild(fleet, "generator-0", before=killed)
        fleet.terminate(timeout=2)  # the stand-ins die of SIGTERM; their children by the group's SIGKILL
        assert gone_within([stopped, restarted], 5) == []
    finally:
        end(killed, stopped, *([restarted] if restarted else []))


def test_kill_group_refuses_the_groups_of_the_system():
    with pytest.raises(ValueError, match=r"pgid \(1\) must be a component's PID above 1"):
        process_tree.kill_group(1)
