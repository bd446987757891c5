"""The Ray actor behind each component of a ``RayFleet``: it holds the role's resources on its node
and supervises one child process (``python -m asyncrl.fleet.child ...``), see ``asyncrl.fleet.ray_cluster``.

``ActorLost`` is the exit status the fleet reports for a component whose actor is gone.

No orphans under Ray either (``asyncrl.fleet.process_tree``). The component leads a process group
of its own, so a kill reaches what it started (vLLM's engine core) and not the actor; ``wait``
kills what is left of the group once the component exits, before reaping it. If the actor dies,
``PR_SET_PDEATHSIG`` SIGKILLs the component and the component's children end its group (their
parent watch). Ray 2.60 has a clean-up of its own: each worker leads its own process group
(``RAY_process_group_cleanup_enabled``; a worker's pgid equals its PID in a local Ray 2.60) which
the raylet kills when the worker exits; a component, in a session of its own, is outside it on
purpose (a kill of the component must not kill the actor), hence the mechanisms above.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import ray

from asyncrl.fleet import process_tree
from asyncrl.wire.endpoints import free_ports


class ActorLost(int):
    """The exit status of a component whose actor is gone: -9 (as if SIGKILLed), plus where it ran.

    >>> lost = ActorLost("a1b2c3d4e5f6a7b8", "10.0.0.7", node_died=True)
    >>> lost, int(lost)
    (lost with node a1b2c3d4e5f6 (10.0.0.7), -9)
    """

    node_id: str
    node_ip: str
    node_died: bool

    def __new__(cls, node_id: str, node_ip: str, node_died: bool) -> ActorLost:
        lost = super().__new__(cls, -signal.SIGKILL)
        lost.node_id, lost.node_ip, lost.node_died = node_id, node_ip, node_died
        return lost

    def __repr__(self) -> str:
        what = "lost with node" if self.node_died else "actor lost on live node"
        return f"{what} {self.node_id[:12]} ({self.node_ip})"

    __str__ = __repr__


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it (the actor's) ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux: Ray's own clean-up of worker children still applies
        pass


@ray.remote(max_concurrency=4)  # wait() blocks while start/signal/locate are answered
class ComponentActor:
    """Holds one component's resources on its node and supervises its child process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def locate(self, bind_host: str, num_ports: int) -> dict:
        """Where this actor runs, and ``num_ports`` ports free on its node's bind address now."""
        ip = ray.util.get_node_ip_address()
        host = ip if bind_host == "node" else bind_host
        ports = free_ports(num_ports, host)
        context = ray.get_runtime_context()
        labels = {k: v for k, v in context.get_node_labels().items() if not k.startswith("ray.io/")}
        return {"node_id": context.get_node_id(), "ip": ip, "host": host, "ports": ports, "labels": labels}

    def start(self, cmd: list[str], settings: dict[str, str], cwd: str, log_path: str, append: bool) -> int:
        """Start the component (``cmd`` with this node's Python) and return its PID on this node."""
        env = {**os.environ, **settings, process_tree.PARENT_ENV: str(os.getpid())}
        # The controller's machine may have no GPU while this node has: decide here.
        env["DS_ACCELERATOR"] = "cuda" if ray.get_gpu_ids() else "cpu"
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a" if append else "w") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, *cmd],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd if os.path.isdir(cwd) else None,
                preexec_fn=_die_with_parent,
                **process_tree.popen_kwargs(),
            )
        return self.proc.pid

    def wait(self) -> int:
        """Block until the child exits, kill what is left of its process group, and return its exit
        code (negative: the signal that ended it)."""
        os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        process_tree.kill_group(self.proc.pid)
        return self.proc.wait()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the child; SIGKILL goes to its whole process group. Signal 0 only
        checks that this actor answers."""
        if self.proc is None or signum == 0 or process_tree.exited_unreaped(self.proc.pid):
            return
        if signum == signal.SIGKILL:
            process_tree.kill_group(self.proc.pid)
        else:
            self.proc.send_signal(signum)
