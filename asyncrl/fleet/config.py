"""The fleet's sections of the run config: where components run (``launcher``), the resources
of each role (``placement``: its GPUs on this machine, or its resources and nodes on a Ray
cluster), and what happens when one dies (``supervision``).

Kept apart from the code that uses them (``asyncrl.fleet.launcher``, ``asyncrl.fleet.placement``,
``asyncrl.controller.supervision``) so that the root config (``asyncrl.config``) imports from the
fleet only these declarations, which import nothing of the package but ``asyncrl.configbase``
and the role table.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config
from asyncrl.roles import ROLE_NAMES


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
    gpus: int | None = Field(None, ge=0)
    """GPUs of this machine the local launcher shares out by ``placement.<role>.num_gpus``
    (``asyncrl.fleet.gpu_plan``); None: as many as ``torch.cuda.device_count()`` sees. Give it to
    plan for another machine (``asyncrl show-config``) or to test a plan on a machine without GPUs."""
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
        if self.kind == "ray" and self.gpus is not None:
            raise ValueError(f"launcher.gpus ({self.gpus}) is for launcher.kind local: Ray counts each node's GPUs")
        return self


class RolePlacement(Config):
    """The resources of every instance of one role, and the nodes it may run on (``labels``, Ray only)."""

    count: int | None = Field(None, ge=1)
    """Instances of this role; None: as many as the run starts (``run.num_generators`` generators,
    one of every other role). When given it must agree with the run; for the learner it is the
    number of ranks (``learner.ranks``), kept in one placement group."""
    num_cpus: float = Field(1.0, ge=0)
    """Logical CPUs each instance reserves on its node."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs each instance gets, its ``CUDA_VISIBLE_DEVICES``: whole devices, or a fraction (below 1)
    of one it shares with others. Local launcher: devices of this machine by
    ``asyncrl.fleet.gpu_plan`` (a learner rank at most 1); Ray: Ray's. 0: none (with the local
    launcher, none visible once any role asks for GPUs; when none asks, every process sees all)."""
    labels: dict[str, str] = {}
    """Node labels an instance must run on (a Ray label selector, e.g. ``{pool: cpu}``; values may
    use Ray's ``!v`` and ``in(a,b)`` forms); empty: any node with the resources."""

    @model_validator(mode="after")
    def _check_gpus(self) -> RolePlacement:
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"num_gpus ({self.num_gpus}) above 1 must be a whole number of GPUs")
        return self


class PlacementConfig(Config):
    """Per-role resources: the GPUs of each process on this machine (``launcher.kind: local``), or
    CPUs, GPUs and node labels on a Ray cluster; every role defaults to one CPU and no GPU."""

    generator: RolePlacement = RolePlacement()
    """Each generator (one vLLM engine: ``engine.tensor_parallel_size`` GPUs when on GPUs)."""
    reward: RolePlacement = RolePlacement()
    """Each reward worker; a natural tenant of CPU-only nodes unless it runs a reward model."""
    buffer: RolePlacement = RolePlacement()
    """The replay buffer service."""
    dispatcher: RolePlacement = RolePlacement()
    """The prompt dispatcher."""
    learner: RolePlacement = RolePlacement()
    """Each learner rank (DeepSpeed); the ranks form one placement group."""
    learner_strategy: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK"
    """How the learner's placement group spreads its ranks: every rank on one node (STRICT_PACK),
    or as few nodes as possible (PACK)."""
    reference: RolePlacement = RolePlacement()
    """The KL reference process (``algorithm.kl.reference: process``)."""

    def check_counts(self, num_generators: int, learner_ranks: int = 1) -> None:
        """Each role's ``count``, where given, must equal how many instances the run starts."""
        expected = {role: 1 for role in ROLE_NAMES} | {"generator": num_generators, "learner": learner_ranks}
        for role, n in expected.items():
            count = getattr(self, role).count
            if count is not None and count != n:
                source = {"generator": "run.num_generators", "learner": "learner.ranks"}.get(role, "the run")
                raise ValueError(f"placement.{role}.count ({count}) must equal the {n} that {source} starts")


class SupervisionConfig(Config):
    restart: bool = True
    """Start a dead generator, reward worker, reference or buffer again (False: a death stops the run)."""
    restore_on_crash: bool = True
    """When the learner or the dispatcher dies, restart the whole run from its last checkpoint."""
    max_restarts: int = Field(10, ge=0)
    """Restarts allowed per component (restores of the whole run count once per component)."""
    backoff_initial_s: float = Field(1.0, ge=0)
    """Wait before the first restart of a component."""
    backoff_max_s: float = Field(30.0, ge=0)
    """The wait doubles with each restart of the same component, up to this."""
    joined_timeout_s: float = Field(30.0, ge=5)
    """Seconds without a word from a process that joined by address (``asyncrl generator
    --connect``, ``asyncrl reward-worker --connect``; each sends a heartbeat every 2 s) after
    which it is taken for dead: what it held is handed out again, and the death reported."""
