"""The addresses of a run's sockets, chosen by the controller and written to ``endpoints.json``.

Every child process reads this file; nothing else carries addresses. Ports are picked free on
127.0.0.1 at start, below the kernel's ephemeral range (``free_ports``: the connections opened
until the children bind cannot take them; a program choosing the same port on purpose still
can, and fails loudly at bind). On a Ray cluster with ``launcher.bind_host: node`` the
controller's own sockets are on its machine's address, and ``asyncrl.fleet.ray_cluster`` rewrites the
addresses each role binds (``BOUND_BY``) to its node's address and ports free there, before any
process that connects to them starts.
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from asyncrl.roles import ROLES


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
    evals: str | None = None
    """PUSH of the controller: held-out evaluation requests to the generators (``asyncrl.tasks.heldout``)."""

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


CONTROLLER_BINDS = ("events", "control", "evals")
"""The addresses the controller binds."""

BOUND_BY: dict[str, tuple[str, ...]] = {"controller": CONTROLLER_BINDS, **{r.name: r.binds for r in ROLES if r.binds}}
"""Which process binds each address (of the roles, as ``asyncrl.roles.ROLES`` declares; the owner
reward worker binds the reward ones); every other process connects to it."""


def tcp_address(port: int, host: str = "127.0.0.1") -> str:
    return f"tcp://{host}:{port}"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, picked outside the kernel's ephemeral range.

    The processes that bind them start seconds later. Meanwhile every outgoing connection on the
    machine takes its source port from the ephemeral range, as does every ``bind`` to port 0, so
    a port picked there can be taken before its owner binds it (a test suite or a busy host
    opens thousands of connections). Below that range only a program choosing the same number
    on purpose collides. Where the range leaves no room below it, the kernel picks (port 0).
    """
    low, _high = ephemeral_range()
    pool = range(PORT_FLOOR, low) if low - PORT_FLOOR >= 4 * n else range(0)
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        for port in rng.sample(pool, min(len(pool), 64 * n)):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:  # in use, or just released (TIME_WAIT): the next one
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


PORT_FLOOR = 10_000
"""Lowest port ``free_ports`` picks (below it lie the well-known and most registered services)."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and port-0 binds (Linux's default
    where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
