"""The component processes of one run, started, watched, restarted and stopped by PID.

``ProcessFleet`` is the embedded default: every component is a local child process
(``python -m asyncrl.fleet.child ROLE NAME RUN_DIR MODEL_DIR``), its output in ``RUN_DIR/logs/NAME.log``.
Another launcher (a cluster) implements the same few methods; the controller uses nothing else.

Each component leads a process group of its own, and whatever it starts (vLLM's engine core) is
in that group: killing, restarting, stopping or finding dead a component SIGKILLs its whole
group before its exit status is reaped, so nothing it started outlives it
(``asyncrl.fleet.process_tree``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.fleet import process_tree


class ProcessFleet:
    """Local child processes, one per component, known by name."""

    def __init__(self, run_dir: Path, model_dir: Path, env: dict[str, str]):
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        self.roles: dict[str, str] = {}
        self.extra_env: dict[str, dict[str, str]] = {}
        self.starts: dict[str, int] = {}
        (run_dir / "logs").mkdir(exist_ok=True)

    def start(self, role: str, name: str, extra_env: dict[str, str] | None = None) -> None:
        """Start component ``name`` with ``role``; a restart appends to the same log."""
        self.starts[name] = self.starts.get(name, 0) + 1
        logf = open(self.run_dir / "logs" / f"{name}.log", "a" if self.starts[name] > 1 else "w")
        self.extra_env[name] = dict(extra_env or {})
        env = {**self.env, **self.extra_env[name], process_tree.PARENT_ENV: str(os.getpid())}
        self.procs[name] = subprocess.Popen(
            self.command(role, name),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=os.getcwd(),
            **process_tree.popen_kwargs(),
        )
        self.roles[name] = role
        logf.close()

    def command(self, role: str, name: str) -> list[str]:
        """The command line that runs component ``name``."""
        return [sys.executable, "-m", "asyncrl.fleet.child", role, name, str(self.run_dir), str(self.model_dir)]

    def restart(self, name: str, extra_env: dict[str, str] | None = None) -> None:
        """Start ``name`` again with the role and environment it had (after it died), ``extra_env``
        overriding some of that environment."""
        self.kill(name)
        self.start(self.roles[name], name, {**self.extra_env[name], **(extra_env or {})})

    def names(self, role: str) -> list[str]:
        return [n for n, r in self.roles.items() if r == role]

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def dead(self) -> dict[str, int]:
        """Processes that exited with an error (name -> exit code; negative: killed by that signal).
        A component found exited has its process group killed first (``settle``)."""
        for name in self.procs:
            self.settle(name)
        return {n: p.returncode for n, p in self.procs.items() if p.returncode not in (None, 0)}

    def exited(self, names: list[str]) -> bool:
        for name in names:
            self.settle(name)
        return all(self.procs[n].returncode is not None for n in names)

    def settle(self, name: str) -> int | None:
        """If ``name`` has exited: SIGKILL what is left of its process group, then reap it and
        return its exit code; None while it runs. Never blocks."""
        p = self.procs[name]
        if p.returncode is None and process_tree.exited_unreaped(p.pid):
            process_tree.kill_group(p.pid)  # before reaping: the group's id is still our child's PID
            p.wait()
        return p.returncode

    def kill(self, name: str) -> None:
        """SIGKILL ``name``'s process group (the component and all it started, if any still runs)
        and reap it."""
        p = self.procs[name]
        if p.returncode is None:
            process_tree.kill_group(p.pid)
            p.wait()

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop every child this run started, by PID: TERM to each component (it shuts its engine
        down), then SIGKILL to each component's process group, whatever is left of it, once the
        component has exited or after ``timeout``."""
        for p in self.procs.values():
            if p.returncode is None and not process_tree.exited_unreaped(p.pid):
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            if p.returncode is None:
                process_tree.wait_unreaped(p.pid, max(0.1, deadline - time.monotonic()))
                process_tree.kill_group(p.pid)
                p.wait()
