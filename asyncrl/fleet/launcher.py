"""How a run's components are started: local child processes, or Ray actors on a cluster.

``launcher.kind: local`` (the default) is ``ProcessFleet``: no cluster, nothing to install. With
``launcher.kind: ray`` the controller joins a Ray cluster (``launcher.address``) or starts a private
one, and ``RayFleet`` starts every component as a Ray actor placed by the ``placement`` section.
Either way the components are the same processes talking ZeroMQ to each other; only where they
run, and the host their sockets bind on, change.

Addresses: with ``bind_host: 127.0.0.1`` every socket binds on the loopback, which is right when
every Ray node is this machine (``ray.cluster_utils.Cluster`` in tests, or one big box). With
``bind_host: node`` each process binds on the address Ray knows its node by and the controller on
its own machine's; ``RayFleet`` writes those addresses into ``endpoints.json`` before any process
that connects to them starts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.fleet.config import LauncherConfig
from asyncrl.roles import Role, start_order

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.fleet.local import ProcessFleet
    from asyncrl.fleet.ray_cluster import RayFleet


def controller_host(launcher: LauncherConfig) -> str:
    """The host the controller binds its event and control sockets on, reachable from every node."""
    if launcher.bind_host == "127.0.0.1":
        return "127.0.0.1"
    import ray.util

    return ray.util.get_node_ip_address()


def make_fleet(cfg: RunConfig, run_dir: Path, model_dir: Path, env: dict[str, str]) -> ProcessFleet | RayFleet:
    """The fleet the controller starts its components with, by ``launcher.kind``."""
    if cfg.launcher.kind == "local":
        from asyncrl.fleet.local import ProcessFleet

        return ProcessFleet(run_dir, model_dir, env)
    from asyncrl.fleet.ray_cluster import RayFleet

    # Only what the controller adds to its own environment travels: PATH, HOME, CUDA_VISIBLE_DEVICES
    # and the like are each node's own.
    settings = {k: v for k, v in env.items() if os.environ.get(k) != v}
    launcher = cfg.launcher
    if launcher.address == "local" and launcher.num_cpus is None:
        launcher = launcher.model_copy(update={"num_cpus": max(os.cpu_count() or 1, math.ceil(placed_cpus(cfg)))})
    return RayFleet(run_dir, model_dir, settings, launcher, cfg.placement, binding_roles(cfg), cfg.learner.ranks)


def placed_cpus(cfg: RunConfig) -> float:
    """Logical CPUs the placement reserves for every component this run starts."""
    p = cfg.placement
    generators = len(process_names(cfg, "generator")) * p.generator.num_cpus
    return generators + sum(getattr(p, role).num_cpus for role in binding_roles(cfg))


def run_roles(cfg: RunConfig) -> list[Role]:
    """The roles this run starts, in start order (``asyncrl.roles``): every role but an optional
    one the config does not ask for (the reference process: ``algorithm.kl.reference: process``)."""
    reference = cfg.algorithm.uses_reference and cfg.algorithm.kl.reference == "process"
    return [r for r in start_order() if not r.optional or (r.name == "reference" and reference)]


def process_names(cfg: RunConfig, role: str) -> list[str]:
    """The names of the processes of ``role`` this run starts."""
    from asyncrl.generators.multiplex import generator_process_names

    if role == "generator":
        return generator_process_names(cfg)  # several simulated engines may share one process
    if role == "reward":
        return ["reward-0"]  # the owner of the stream; more workers may join by address
    if role == "learner":
        return learner_process_names(cfg.learner.ranks)
    return [role]


def learner_process_names(ranks: int) -> list[str]:
    """The learner's processes, by rank: rank 0 is ``learner`` (it talks to the buffer, the
    generators and the controller for the group), rank r > 0 ``learner-r``.

    >>> learner_process_names(3)
    ['learner', 'learner-1', 'learner-2']
    """
    return ["learner"] + [f"learner-{rank}" for rank in range(1, ranks)]


def learner_rank_env(ranks: int, master_port: int) -> list[dict[str, str]]:
    """Each learner rank's DeepSpeed rendezvous on this machine, in rank order: ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's, shared by all).
    A Ray fleet on several machines replaces the master's address with rank 0's node."""
    return [
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
        }
        for rank in range(ranks)
    ]


def binding_roles(cfg: RunConfig) -> list[str]:
    """The roles of this run whose processes bind an address that others connect to, in start order."""
    return [r.name for r in run_roles(cfg) if r.binds]
