"""The addresses of a run's sockets, chosen by the controller and written to ``endpoints.json``.

Every child process reads this file; nothing else carries addresses. Ports are picked free on
127.0.0.1 at start (a tiny race with other programs is possible and fails loudly at bind). On a
Ray cluster with ``launcher.bind_host: node`` the controller's own sockets are on its machine's
address, and ``asyncrl.ray_fleet`` rewrites the addresses each role binds (``BOUND_BY``) to its
node's address and ports free there, before any process that connects to them starts.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class Endpoints(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dispatcher: str
    """ROUTER of the dispatcher: generators ask for prompts here."""
    reward_in: str
    """PULL of the reward workers: generators push sampled groups here."""
    buffer_in: str
    """PULL of the buffer: reward workers push scored groups here."""
    buffer_requests: str
    """ROUTER of the buffer: learners ask for batches here."""
    buffer_status: str
    """PUB of the buffer: learner version and retired groups, for the dispatcher's admission rule."""
    weights: str
    """PUB of the learner: announcements of published weights."""
    weights_stream: str | None = None
    """PUB of the learner: streamed weight buckets (``weights.transport: zmq``)."""
    events: str
    """PULL of the controller: progress and reports from every process."""
    control: str
    """PUB of the controller: commands (stop) to every process."""
    reward_share: str | None = None
    """ROUTER of the first reward worker: hot-plugged reward workers ask for groups to score here."""
    reference: str | None = None
    """ROUTER of the reference process (``algorithm.kl.reference: process``): reference logprobs."""

    @classmethod
    def allocate(cls, host: str = "127.0.0.1") -> Endpoints:
        """Every address on ``host`` (the controller's machine), at ports free there now."""
        names = list(cls.model_fields)
        ports = free_ports(len(names), host)
        return cls(**{name: tcp_address(port, host) for name, port in zip(names, ports)})

    def save(self, run_dir: Path) -> None:
        (run_dir / "endpoints.json").write_text(self.model_dump_json(indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> Endpoints:
        return cls(**json.loads((run_dir / "endpoints.json").read_text()))


BOUND_BY = {
    "controller": ("events", "control"),
    "buffer": ("buffer_in", "buffer_requests", "buffer_status"),
    "reward": ("reward_in", "reward_share"),
    "dispatcher": ("dispatcher",),
    "learner": ("weights", "weights_stream"),
    "reference": ("reference",),
}
"""Which role binds each address (the owner reward worker binds the reward ones); every other
process connects to it."""


def tcp_address(port: int, host: str = "127.0.0.1") -> str:
    return f"tcp://{host}:{port}"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
