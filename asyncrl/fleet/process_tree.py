"""No orphans: every process a run starts goes down with the process that started it.

Why this is needed. vLLM's ``AsyncLLM`` runs its engine core (``VLLM::EngineCore``) as a child of
the generator: ``CoreEngineProcManager`` (``vllm/v1/engine/utils.py``) starts it with
``multiprocessing`` (``fork`` by default, ``spawn`` once CUDA is initialised or inside a Ray
actor), with no ``setsid``, no ``PR_SET_PDEATHSIG`` and no watch of its parent. A generator that
dies without closing its engine (SIGKILL, the kernel's OOM killer, ``os._exit(1)`` after a crash)
leaves the engine core re-parented to init, holding its memory; each restart adds one more.

How. Three mechanisms, each covering what the others cannot:

1. **One process group per component.** The fleet starts every component in a session of its own
   (``start_new_session=True``, ``popen_kwargs``); whatever the component starts (vLLM's engine
   core, its workers, multiprocessing's resource tracker) stays in that group unless it leaves
   on purpose. Whenever the fleet kills, restarts, stops or finds dead a component, it SIGKILLs
   the group (``kill_group``) *before* it reaps the component's exit status: until then the
   component's PID, which is the group's id, cannot be given to another process, so the signal
   reaches only processes we started.
2. **A component watches its parent** (``watch_parent``): when the process that started it (the
   controller, or a Ray actor) is gone, it SIGKILLs its own group, itself included. That covers a
   controller that was SIGKILLed or crashed, which can stop nothing.
3. **A component's children watch theirs** (``arm_children``): a child forked from a component
   (``os.fork``: multiprocessing's ``fork``) runs the same watch from its first instant, and so
   does one spawned by multiprocessing (``spawn``: it imports the component's main module as
   ``__mp_main__``, where ``asyncrl.fleet.child`` arms it). So an engine core whose generator
   died takes the group down even when nobody else is left to do it (controller and generator
   killed together).

A watch polls ``os.getppid()`` every ``WATCH_S``: a parent's death re-parents its children (to
init, or to the nearest subreaper), so a change of parent PID is a death, whatever signal or
exit caused it. ``PR_SET_PDEATHSIG`` was not used for this: it fires when the *thread* that
started the child ends, not the process, so a child started from a worker thread would be
killed with that thread; and it cannot run code, so it could kill the component but not its
group. A process that puts itself in a new session on purpose (``setsid``) leaves the group and
is covered only by its own watch, if it has one. Nothing here finds processes by name: only by
the PIDs and process groups we created.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

WATCH_S = 0.5
"""Seconds between two looks at the parent's PID: the longest an orphan lives before it ends its group."""
PARENT_ENV = "ASYNCRL_PARENT_PID"
"""Set by whoever starts a component to its own PID: the component's watch knows its parent even if
that parent died before the watch began."""


def popen_kwargs() -> dict:
    """What ``subprocess.Popen`` needs for a component: its own session, hence its own process
    group (whose id is the component's PID), out of reach of the terminal's Ctrl-C (the
    controller stops its components itself)."""
    return {"start_new_session": True}


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to every process of group ``pgid``; False when the group is already empty.

    Call it before reaping the group leader (``exited_unreaped``), or while a member is known to
    live: only then is ``pgid`` sure to be ours."""
    if pgid <= 1:
        raise ValueError(f"pgid ({pgid}) must be a component's PID above 1, never a group of the system")
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def exited_unreaped(pid: int) -> bool:
    """Whether our child ``pid`` has exited, leaving it unreaped (its PID stays reserved, so its
    process group can still be killed safely); False while it runs."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True  # reaped already (by someone else): nothing left to wait for
    return info is not None


def wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for our child ``pid`` to exit, without reaping it."""
    deadline = time.monotonic() + timeout
    while not exited_unreaped(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes of group ``pgid`` (zombies excluded), read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[2] == pgid and stat[0] != "Z":
                members.append(int(entry.name))
    return sorted(members)


def descendants(pid: int) -> list[int]:
    """PIDs of the live descendants of ``pid`` (children, their children...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return sorted(out)


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (zombies count as gone: they hold no memory)."""
    return [p for p in pids if (s := _stat(p)) is not None and s[0] != "Z"]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of ``pid`` from /proc/PID/stat, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and ')'
    return fields[0], int(fields[1]), int(fields[2])


def watch_parent(parent: int | None = None, interval_s: float = WATCH_S) -> threading.Thread:
    """Start a daemon thread that SIGKILLs this process's group once ``parent`` (default: the
    parent now) is no longer this process's parent. A parent already gone ends the group now."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        _end_own_group(parent)

    if os.getppid() != parent:
        _end_own_group(parent)
    thread = threading.Thread(target=watch, name="asyncrl-parent-watch", daemon=True)
    thread.start()
    return thread


def parent_from_env() -> int | None:
    """The parent PID the fleet wrote into ``PARENT_ENV`` (None when this process was started by hand)."""
    value = os.environ.get(PARENT_ENV, "")
    return int(value) if value.isdigit() else None


def guard_component() -> None:
    """What a component process does first: watch the parent that started it (``PARENT_ENV``, else
    its parent now) and make every child it forks watch it in turn."""
    watch_parent(parent_from_env())
    os.environ.pop(PARENT_ENV, None)  # not inherited: this process's own children watch it
    arm_children()


_armed = False
_forker = 0
"""The PID of the process that forked last, set in it just before the fork: the child reads its
copy, so it knows its parent even when that parent is killed before the child first runs."""


def arm_children() -> None:
    """Make every child this process forks from now on watch this process (``watch_parent``):
    if this process dies first, the child ends its group. Idempotent."""
    global _armed
    if not _armed:
        os.register_at_fork(before=_remember_forker, after_in_child=_watch_after_fork)
        _armed = True


def _remember_forker() -> None:
    global _forker
    _forker = os.getpid()


def _watch_after_fork() -> None:
    # Not os.getppid(): under load the parent may be killed before the child first runs, and the
    # child would then take init for its parent. Registered handlers pass to the child's forks too.
    watch_parent(_forker)


def _end_own_group(parent: int) -> None:
    """SIGKILL this process's group if it is one of ours (led by this process, or by the parent
    that died); otherwise (a component started by hand inside a shell's or a test runner's
    group) this process alone."""
    # No logging call here: another thread may hold the logging lock when this runs, and the
    # group (this process included) must go down regardless.
    pgid = os.getpgid(0)
    ours = pgid in (os.getpid(), parent)
    what = f"process group {pgid}" if ours else f"process {os.getpid()}"
    os.write(2, f"asyncrl: parent {parent} is gone: ending {what}\n".encode())
    if ours:
        os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
