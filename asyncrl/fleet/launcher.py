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
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.fleet.local import ProcessFleet
    from asyncrl.fleet.ray_cluster import RayFleet


class LauncherConfig(Config):
    """Where the components run. ``launcher: ray`` is short for ``launcher: {kind: ray}``."""

    kind: Literal["local", "ray"] = "local"
    """``local``: child processes of the controller on this machine; ``ray``: Ray actors, placed by
    the ``placement`` section, on the cluster at ``address``."""
    address: str = "local"
    """The Ray cluster to join (``kind: ray``): ``local`` starts a private one on this machine for the
    run and stops it at the end; ``auto`` joins the one ``ray start`` runs here; ``HOST:PORT`` is the
    head node's GCS address of a cluster elsewhere."""
    bind_host: Literal["127.0.0.1", "node"] = "127.0.0.1"
    """Host every socket binds on: 127.0.0.1 when every node is this machine; ``node``: the address
    Ray knows each process's node by (the controller: its own machine's), for several machines."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of the private Ray instance (``address: local``); None: this machine's CPUs, or
    as many as the placement asks for when that is more (the processes then share the cores)."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """Seconds a component may wait for a node with the resources and labels it asks for, before
    the run fails naming them."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check_bind_host(self) -> LauncherConfig:
        if self.kind == "local" and self.bind_host != "127.0.0.1":
            raise ValueError(f"launcher.bind_host ({self.bind_host!r}) must be 127.0.0.1 with launcher.kind local")
        return self


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
    return RayFleet(run_dir, model_dir, settings, launcher, cfg.placement, binding_roles(cfg))


def placed_cpus(cfg: RunConfig) -> float:
    """Logical CPUs the placement reserves for every component this run starts."""
    from asyncrl.generators.multiplex import generator_process_names

    p = cfg.placement
    generators = len(generator_process_names(cfg)) * p.generator.num_cpus
    return generators + sum(getattr(p, role).num_cpus for role in binding_roles(cfg))


def binding_roles(cfg: RunConfig) -> list[str]:
    """The roles of this run whose processes bind an address that others connect to."""
    roles = ["buffer", "reward", "dispatcher", "learner"]
    if cfg.algorithm.kl.enabled and cfg.algorithm.kl.reference == "process":
        roles.append("reference")
    return roles
