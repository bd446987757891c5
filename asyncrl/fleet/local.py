"""The component processes of one run, started, watched, restarted and stopped by PID.

``ProcessFleet`` is the embedded default: every component is a local child process
(``python -m asyncrl.fleet.child ROLE NAME RUN_DIR MODEL_DIR``), its output in ``RUN_DIR/logs/NAME.log``.
Another launcher (a cluster) implements the same few methods; the controller uses nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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
        cmd = [sys.executable, "-m", "asyncrl.fleet.child", role, name, str(self.run_dir), str(self.model_dir)]
        self.extra_env[name] = dict(extra_env or {})
        self.procs[name] = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env={**self.env, **self.extra_env[name]}, cwd=os.getcwd()
        )
        self.roles[name] = role
        logf.close()

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
        """Processes that exited with an error (name -> exit code; negative: killed by that signal)."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None and p.returncode != 0}

    def exited(self, names: list[str]) -> bool:
        return all(self.procs[n].poll() is not None for n in names)

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (if it still runs) and reap it."""
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop every child this run started, by PID: TERM, then KILL after ``timeout``."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
