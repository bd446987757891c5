"""Where each component runs on a Ray cluster: per role, how many, the CPUs and GPUs each one
reserves, and the node labels it needs (``placement`` section; the local launcher reads only
``num_gpus`` and ``count``, in ``asyncrl.fleet.gpu_plan``).

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

    >>> from asyncrl.fleet.config import PlacementConfig
    >>> p = PlacementConfig(generator=RolePlacement(num_gpus=2, labels={"pool": "gpu"}))
    >>> actor_options(p.generator)
    {'num_cpus': 1.0, 'num_gpus': 2.0, 'label_selector': {'pool': 'gpu'}}
"""

from __future__ import annotations

from asyncrl.fleet.config import RolePlacement


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
