"""Where each component runs on a Ray cluster: per role, how many, the CPUs and GPUs each one
reserves, and the node labels it needs (``placement`` section; read only with ``launcher.kind: ray``).

Heterogeneous by role, as in verl's resource pools: generators can ask for GPUs on nodes labelled
for inference, reward workers for a CPU or two on CPU-only nodes, the learner's ranks for GPUs kept
together on one node. Resources are Ray's logical ones (a node declares ``--num-cpus``/``--num-gpus``
and ``--labels``); a component waits at most ``launcher.placement_timeout_s`` for a node that has
them, then the run fails naming the role, what it asked for and what the cluster has.

The learner's ranks are one placement group with one bundle per rank (``STRICT_PACK``: every rank
on one node, so NCCL/gloo stay on the node's fast links; ``PACK`` lets a group larger than a node
spill over). Every other component is a plain actor with its own resource request, so Ray may put a
restarted generator or reward worker on any alive node that satisfies it.

The critic (``algorithm.critic``) is an engine inside the learner ranks: its GPUs are the
learner's. A generator's tensor-parallel size is ``engine.tensor_parallel_size``; its placement
reserves that many GPUs per generator when it asks for GPUs at all.

    >>> p = PlacementConfig(generator=RolePlacement(num_gpus=2, labels={"pool": "gpu"}))
    >>> actor_options(p.generator)
    {'num_cpus': 1.0, 'num_gpus': 2.0, 'label_selector': {'pool': 'gpu'}}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config

ROLES = ("generator", "reward", "buffer", "dispatcher", "learner", "reference")
"""The roles a run starts (as in ``asyncrl.fleet.child``), each one a field of ``PlacementConfig``."""


class RolePlacement(Config):
    """The resources of every instance of one role, and the nodes it may run on."""

    count: int | None = Field(None, ge=1)
    """Instances of this role; None: as many as the run starts (``run.num_generators`` generators,
    one of every other role). When given it must agree with the run; for the learner it is the
    number of ranks, kept in one placement group."""
    num_cpus: float = Field(1.0, ge=0)
    """Logical CPUs each instance reserves on its node."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs each instance reserves (Ray sets ``CUDA_VISIBLE_DEVICES`` to them); 0 on CPU-only nodes."""
    labels: dict[str, str] = {}
    """Node labels an instance must run on (a Ray label selector, e.g. ``{pool: cpu}``; values may
    use Ray's ``!v`` and ``in(a,b)`` forms); empty: any node with the resources."""

    @model_validator(mode="after")
    def _check_gpus(self) -> RolePlacement:
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"num_gpus ({self.num_gpus}) above 1 must be a whole number of GPUs")
        return self


class PlacementConfig(Config):
    """Per-role resources on a Ray cluster; every role defaults to one CPU on any node."""

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
        expected = {role: 1 for role in ROLES} | {"generator": num_generators, "learner": learner_ranks}
        for role, n in expected.items():
            count = getattr(self, role).count
            if count is not None and count != n:
                source = "run.num_generators" if role == "generator" else "the run"
                raise ValueError(f"placement.{role}.count ({count}) must equal the {n} that {source} starts")


def actor_options(p: RolePlacement) -> dict:
    """Ray actor options for one instance of a role (resources and label selector)."""
    options: dict = {"num_cpus": float(p.num_cpus), "num_gpus": float(p.num_gpus)}
    if p.labels:
        options["label_selector"] = dict(p.labels)
    return options


def learner_bundles(p: RolePlacement, ranks: int) -> tuple[list[dict[str, float]], list[dict[str, str]] | None]:
    """The learner's placement group: one bundle per rank, and the label selector of each bundle."""
    bundle = {"CPU": float(p.num_cpus)} | ({"GPU": float(p.num_gpus)} if p.num_gpus else {})
    selectors = [dict(p.labels) for _ in range(ranks)] if p.labels else None
    return [dict(bundle) for _ in range(ranks)], selectors
