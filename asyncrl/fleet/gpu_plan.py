"""Which GPUs of this machine each process of a local run gets (``launcher.kind: local``).

The plan is computed once from the config (``placement.<role>.num_gpus`` for every process the
run starts) and the machine's devices, before any process starts; a plan that does not fit fails
naming what each role asked for and what exists. Every process then starts with
``CUDA_VISIBLE_DEVICES`` set to its devices, and a restart keeps them. On a Ray cluster Ray sets
that variable itself; this plan is not used there.

Packing: whole-GPU requests (a generator asks for ``engine.tensor_parallel_size`` GPUs) take whole
devices first, in start order. Fractional requests (below 1) are then packed onto the remaining
devices, largest first, each onto the first device with room (first fit decreasing): the fractions
sharing a device never sum past 1, and two learner ranks never share one (NCCL drives one rank per
device). A fraction is a share, not a limit: only a generator holds to it (vLLM takes
``engine.gpu_memory_utilization`` of the device, which the config keeps within its fraction).

Visibility: once any role asks for GPUs, a process that asks for none sees none (an empty
``CUDA_VISIBLE_DEVICES``, as under Ray); when no role asks, nothing is set and every process sees
what the controller sees. The learner's ranks each own one device but all see the group's devices
in rank order, so that ``LOCAL_RANK`` (the rank) selects its own and NCCL reaches its peers'
devices directly, as under torchrun.

Devices: ``launcher.gpus`` when given, else ``torch.cuda.device_count()``. The controller has
loaded torch already (``asyncrl.controller.preparation.child_env``), the count comes from NVML
without creating a CUDA context, and it honours the controller's own ``CUDA_VISIBLE_DEVICES``,
whose entries then name the devices that plan indices 0, 1, ... stand for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from asyncrl.fleet.launcher import process_names, run_roles

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

log = logging.getLogger("asyncrl")

GIB = 1 << 30
PACKING_RULE = (
    "whole-GPU requests take whole devices; fractions share the rest, first fit decreasing, "
    "at most 1 per device and one learner rank per device"
)


class GpuRequest(NamedTuple):
    """What one process asks for."""

    name: str
    """The process (``asyncrl.fleet.launcher.process_names``)."""
    role: str
    """Its role."""
    gpus: float
    """``placement.<role>.num_gpus``: whole devices, or a fraction of one."""


@dataclass(frozen=True)
class Devices:
    """The GPUs of this machine the plan shares out."""

    ids: tuple[str, ...]
    """The ``CUDA_VISIBLE_DEVICES`` entry of plan index 0, 1, ...: the controller's own entries
    when it has that variable, else the indices themselves."""
    memory_gib: tuple[float, ...] | None
    """Each device's memory in GiB; None when unknown (a count given by ``launcher.gpus``)."""
    source: str
    """Where the count came from, for messages and the table."""


@dataclass(frozen=True)
class Assignment:
    """One process's GPUs."""

    name: str
    """The process (``asyncrl.fleet.launcher.process_names``)."""
    role: str
    """Its role."""
    asked: float
    """``placement.<role>.num_gpus``: whole devices, or a fraction of one."""
    devices: tuple[int, ...]
    """Plan indices of its devices (empty: it asked for none)."""
    memory: str
    """The device memory it is expected to use, in words (with the figure when known)."""


@dataclass(frozen=True)
class GpuPlan:
    """Every process's GPUs, in start order."""

    devices: Devices
    assignments: tuple[Assignment, ...]

    def env(self, name: str) -> dict[str, str]:
        """The environment process ``name`` starts with: its ``CUDA_VISIBLE_DEVICES``."""
        a = self._by_name(name)
        devices = a.devices
        if a.role == "learner":  # each rank's one device, in rank order: LOCAL_RANK picks its own
            devices = tuple(d for r in self.assignments if r.role == "learner" for d in r.devices)
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices.ids[d] for d in devices)}

    def sharing(self) -> dict[int, list[Assignment]]:
        """Each device (plan index) and the processes on it, in start order."""
        on: dict[int, list[Assignment]] = {d: [] for d in range(len(self.devices.ids))}
        for a in self.assignments:
            for d in a.devices:
                on[d].append(a)
        return on

    def table(self) -> str:
        """The plan for people: process -> GPUs, share, expected memory; then who shares each device."""
        ids = self.devices.ids
        lines = [f"GPU plan ({len(ids)} GPU(s), {self.devices.source}; {PACKING_RULE}):"]
        rows = [("process", "role", "GPUs", "share", "expected memory")]
        for a in self.assignments:
            gpus = ",".join(ids[d] for d in a.devices) or "none"
            share = "-" if not a.devices else "whole" if a.asked >= 1 else f"{a.asked:g}"
            rows.append((a.name, a.role, gpus, share, a.memory))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in rows]
        for d, on in self.sharing().items():
            if len(on) > 1:
                used = sum(a.asked for a in on)
                lines.append(f"  GPU {ids[d]} shared: {' + '.join(a.name for a in on)} ({used:g} of 1)")
            elif not on:
                lines.append(f"  GPU {ids[d]}: unused")
        return "\n".join(lines)

    def _by_name(self, name: str) -> Assignment:
        for a in self.assignments:
            if a.name == name:
                return a
        raise KeyError(f"process {name!r} is not in the GPU plan ({', '.join(a.name for a in self.assignments)})")


def node_devices(gpus: int | None, environ: Mapping[str, str] = os.environ) -> Devices:
    """This machine's GPUs: ``gpus`` of them when given (``launcher.gpus``), else those torch
    sees; named by the controller's ``CUDA_VISIBLE_DEVICES`` entries when it has that variable."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    entries = None if visible is None else [e.strip() for e in visible.split(",") if e.strip()]
    memory = None
    if gpus is not None:
        count, source = gpus, "launcher.gpus"
    else:
        import torch

        count, source = torch.cuda.device_count(), "torch.cuda.device_count()"
        memory = tuple(torch.cuda.get_device_properties(i).total_memory / GIB for i in range(count))
    if entries is None:
        return Devices(tuple(str(i) for i in range(count)), memory, source)
    if count > len(entries):
        raise ValueError(
            f"launcher.gpus ({count}) must be at most the {len(entries)} device(s) the controller's "
            f"CUDA_VISIBLE_DEVICES ({visible}) leaves it"
        )
    return Devices(tuple(entries[:count]), memory, f"{source} of CUDA_VISIBLE_DEVICES={visible}")


def gpu_plan(cfg: RunConfig, devices: Devices | None = None) -> GpuPlan | None:
    """The run's GPU plan on this machine (``devices``: found by ``node_devices`` when None), or
    None when it has none to make: a Ray launcher, or no role asking for GPUs. Raises ValueError
    naming every role's request and the devices that exist when the requests do not fit."""
    if cfg.launcher.kind != "local":
        return None
    asks = [
        GpuRequest(name, r.name, getattr(cfg.placement, r.name).num_gpus)
        for r in run_roles(cfg)
        for name in process_names(cfg, r.name)
    ]
    if not any(gpus for _, _, gpus in asks):
        return None
    if cfg.placement.learner.num_gpus > 1:
        raise ValueError(
            f"placement.learner.num_gpus ({cfg.placement.learner.num_gpus:g}) must be at most 1 with launcher.kind "
            "local: each learner rank drives one GPU (learner.ranks sets how many)"
        )
    devices = devices or node_devices(cfg.launcher.gpus)
    placed = pack([a for a in asks if a.gpus], len(devices.ids))
    if placed is None:
        raise ValueError(oversubscribed(asks, devices))
    assignments = tuple(
        Assignment(
            name, role, gpus, placed.get(name, ()), expected_memory(cfg, role, gpus, placed.get(name, ()), devices)
        )
        for name, role, gpus in asks
    )
    return GpuPlan(devices, assignments)


def pack(asks: list[GpuRequest], count: int) -> dict[str, tuple[int, ...]] | None:
    """Devices (plan indices) for each request on ``count`` devices, by the module's packing
    rule; None when they do not fit.

    >>> pack([GpuRequest("generator-0", "generator", 0.5), GpuRequest("learner", "learner", 0.5)], 1)
    {'generator-0': (0,), 'learner': (0,)}
    >>> pack([GpuRequest("generator-0", "generator", 1.0), GpuRequest("learner", "learner", 0.5)], 1) is None
    True
    """
    placed: dict[str, tuple[int, ...]] = {}
    free = list(range(count))
    for name, _, gpus in asks:
        if gpus >= 1:
            if len(free) < gpus:
                return None
            placed[name], free = tuple(free[: int(gpus)]), free[int(gpus) :]
    used = dict.fromkeys(free, 0.0)
    learner_on: set[int] = set()
    for name, role, gpus in sorted((a for a in asks if a.gpus < 1), key=lambda a: -a.gpus):  # stable: start order
        fits = [d for d in free if used[d] + gpus <= 1 + 1e-9 and not (role == "learner" and d in learner_on)]
        if not fits:
            return None
        used[fits[0]] += gpus
        placed[name] = (fits[0],)
        if role == "learner":
            learner_on.add(fits[0])
    return {name: placed[name] for name, _, _ in asks}


def oversubscribed(asks: list[GpuRequest], devices: Devices) -> str:
    """The error of requests that do not fit: each role's request and what exists."""
    by_role: dict[str, list[str]] = {}
    gpus_of: dict[str, float] = {}
    for name, role, gpus in asks:
        if gpus:
            by_role.setdefault(role, []).append(name)
            gpus_of[role] = gpus
    asked = "; ".join(
        f"{role} {len(names)} x {gpus_of[role]:g} GPU (placement.{role}.num_gpus: {', '.join(names)})"
        for role, names in by_role.items()
    )
    total = sum(gpus_of[role] * len(names) for role, names in by_role.items())
    return (
        f"the GPUs the run asks for ({total:g} in all) do not fit the {len(devices.ids)} of this machine "
        f"({devices.source}): "
        f"{asked}; rule: {PACKING_RULE}"
    )


def expected_memory(cfg: RunConfig, role: str, gpus: float, devices: tuple[int, ...], node: Devices) -> str:
    """What one process is expected to use of its devices, in words."""
    if not devices:
        return "-"
    per_device = None if node.memory_gib is None else min(node.memory_gib[d] for d in devices)
    of_device = "" if per_device is None else f" = {gpus * per_device if gpus < 1 else per_device:.1f} GiB"
    if role == "generator":
        engine = cfg.engine
        if engine.kv_cache_memory_bytes is not None:
            return f"weights + KV cache {engine.kv_cache_memory_bytes / GIB:.2f} GiB (engine.kv_cache_memory_bytes)"
        util = engine.gpu_memory_utilization
        figure = "" if per_device is None else f" = {util * per_device:.1f} GiB"
        return f"engine.gpu_memory_utilization {util:g} x device{figure}" + (" each" if len(devices) > 1 else "")
    if gpus >= 1:
        return f"whole device{of_device}" + (" each" if len(devices) > 1 else "")
    return f"share {gpus:g} x device{of_device} (not enforced)"


def gpu_envs(cfg: RunConfig) -> dict[str, dict[str, str]]:
    """Each process's ``CUDA_VISIBLE_DEVICES`` by the run's plan, the plan logged as a table;
    empty when there is no plan (``gpu_plan``). Raises before anything starts when it does not fit."""
    plan = gpu_plan(cfg)
    if plan is None:
        return {}
    log.info("%s", plan.table())
    return {a.name: plan.env(a.name) for a in plan.assignments}


def describe_gpu_plan(cfg: RunConfig) -> str:
    """The plan's table, or why there is none (``asyncrl show-config``)."""
    plan = gpu_plan(cfg)
    if plan is not None:
        return plan.table()
    if cfg.launcher.kind != "local":
        return f"GPU plan: none here, Ray gives each actor its GPUs (launcher.kind {cfg.launcher.kind})"
    return "GPU plan: no role asks for GPUs (placement.<role>.num_gpus); every process sees the controller's devices"
