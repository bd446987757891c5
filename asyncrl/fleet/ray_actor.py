"""The Ray actor behind each component of a ``RayFleet``: it holds the role's resources on its node
and supervises one child process (``python -m asyncrl.fleet.child ...``), see ``asyncrl.fleet.ray_cluster``.

``ActorLost`` is the exit status the fleet reports for a component whose actor is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import ray

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
        env = {**os.environ, **settings}
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
            )
        return self.proc.pid

    def wait(self) -> int:
        """Block until the child exits; its exit code (negative: the signal that ended it)."""
        return self.proc.wait()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)
