"""The component processes of one run as Ray actors, placed by resources and node labels.

``RayFleet`` has the methods of ``asyncrl.fleet.local.ProcessFleet`` (start, restart, names, pid, dead,
exited, kill, terminate), so the controller drives a cluster exactly as it drives local children.

**One actor supervises one child process.** Each component is a small ``ComponentActor``
(``asyncrl.fleet.ray_actor``) holding the resources of its role; the actor starts ``python -m
asyncrl.fleet.child ROLE NAME RUN_DIR MODEL_DIR`` as a child on its node, writes its output to
``RUN_DIR/logs/NAME.log`` and returns its exit code when it ends. Not running ``asyncrl.fleet.child.main`` inside the actor, because a component then is the
same process as on one machine: its own environment (one math thread, DeepSpeed's rank variables,
vLLM's settings) instead of a Ray worker's, its own ``__main__`` (vLLM spawns engine workers), an
exit code instead of a raised exception, and a SIGTERM that drains it the way the local launcher
does. The actor sees its node's GPUs (Ray sets ``CUDA_VISIBLE_DEVICES``) and the child inherits
them; the child leads a process group of its own and is killed with the actor
(``PR_SET_PDEATHSIG``), its own children ending the group when it is gone
(``asyncrl.fleet.process_tree``), so a lost node or a killed actor leaves no orphan.

**Addresses.** Roles that bind addresses (``endpoints.BOUND_BY``: buffer, owner reward worker,
dispatcher, learner, reference) are placed when the fleet is built, before anything starts; with
``launcher.bind_host: node`` their addresses in ``endpoints.json`` (and the learner's MASTER_ADDR)
are then rewritten to their node's address and ports free there, so every process reads final
addresses. ZeroMQ stays the data plane; Ray only places, starts and watches.

**Node loss.** ``dead()`` reports a component whose child exited with an error by its exit code,
and one whose actor is gone by an ``ActorLost`` (an int, -9 like a SIGKILL, that names the node and
whether the node died). ``restart(name)`` places a new actor with the same resources and labels on
an alive node (Ray never schedules on a dead one) and starts the component again, appending to its
log. A role that binds addresses can move only while ``bind_host`` is 127.0.0.1 (every node is this
machine, the port is the same); with ``bind_host: node`` a new address would not reach the peers
already connected to the old one, so that restart fails naming the rule.

``placement.json`` in the run directory records the node of every component, restarts included.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.fleet.config import LauncherConfig, PlacementConfig
from asyncrl.fleet.placement import actor_options, learner_bundles
from asyncrl.fleet.ray_actor import ActorLost, ComponentActor
from asyncrl.wire.endpoints import BOUND_BY, Endpoints

__all__ = ["ActorLost", "FleetError", "RayFleet"]

log = logging.getLogger(__name__)

DEAD_POLL_S = 0.2
"""``dead()`` asks Ray at most this often; the controller calls it on every event it reads."""
LOSS_WATCH_S = 3.0
"""Seconds a child killed by a signal nobody here sent is watched for its node or actor going down."""


class FleetError(RuntimeError):
    """A component could not be placed or started on the cluster."""


@dataclass
class Component:
    """One component as the fleet knows it: its actor, where it runs, how it exits."""

    role: str
    rank: int
    actor: ray.actor.ActorHandle
    where: dict
    extra_env: dict[str, str] = field(default_factory=dict)
    pid: int = -1
    exit_ref: ray.ObjectRef | None = None
    returncode: int | None = None
    starts: int = 0
    signalled: bool = False
    """The fleet sent its child a signal (so an exit by signal is no loss)."""
    binds: bool = False
    """It binds its role's addresses (``endpoints.BOUND_BY``) that other processes connect to."""

    def poll(self) -> int | None:
        """Its exit status as last collected (None: running), as ``Popen.poll`` answers."""
        return self.returncode


class RayFleet:
    """Ray actors, one per component, known by name; same methods as ``ProcessFleet``."""

    def __init__(
        self,
        run_dir: Path,
        model_dir: Path,
        settings: dict[str, str],
        launcher: LauncherConfig,
        placement: PlacementConfig,
        binding_roles: list[str],
        learner_ranks: int = 1,
    ):
        """Join or start the cluster, reserve the learner's placement group, and place every role
        that binds addresses (``binding_roles``), so that ``endpoints.json`` is final from here on.
        ``settings``: environment variables every component gets on top of its node's own;
        ``learner_ranks``: the learner's processes (``learner.ranks``), one bundle each."""
        self.run_dir = Path(run_dir)
        self.model_dir = model_dir
        self.settings = settings
        self.launcher = launcher
        self.placement = placement
        self.binding_roles = list(binding_roles)
        self.learner_ranks = learner_ranks
        self.procs: dict[str, Component] = {}
        self.reserved: dict[str, Component] = {}
        self.master: dict[str, str] = {}
        self.learner_group = None
        self.history: list[dict] = []
        self._owns_ray = False
        self._open = False
        self._checked_at = 0.0
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self._reserve()

    def _reserve(self) -> None:
        """Connect, reserve the learner's group and place the binding roles (again after ``terminate``,
        when the controller restores the whole run)."""
        if not ray.is_initialized():
            extra = {"include_dashboard": False, "num_cpus": self.launcher.num_cpus}
            ray.init(
                address=self.launcher.address,
                log_to_driver=False,
                **(extra if self.launcher.address == "local" else {}),
            )
            self._owns_ray = True
        self._open = True
        try:
            self.learner_group = self._reserve_learner_group()
            for role in self.binding_roles:
                self.reserved[role] = self._place(role, rank=0)
                self.reserved[role].binds = True
            if self.launcher.bind_host == "node":
                self._bind_on_nodes()
        except BaseException:
            self.terminate()  # nobody else would release what was reserved so far
            raise

    # -- the ProcessFleet interface --------------------------------------------------------------

    @property
    def roles(self) -> dict[str, str]:
        """Name -> role of every component started."""
        return {n: c.role for n, c in self.procs.items()}

    @property
    def starts(self) -> dict[str, int]:
        """Name -> how many times it was started (restarts included)."""
        return {n: c.starts for n, c in self.procs.items()}

    def start(self, role: str, name: str, extra_env: dict[str, str] | None = None) -> None:
        """Start component ``name`` with ``role`` on a node its placement allows."""
        if not self._open:
            self._reserve()
        extra_env = dict(extra_env or {})
        rank = int(extra_env.get("RANK", 0)) if role == "learner" else 0
        comp = self.reserved.pop(role, None) if rank == 0 else None
        comp = comp or self._place(role, rank)
        comp.extra_env = extra_env
        previous = self.procs.get(name)
        self._launch(name, comp, starts=previous.starts + 1 if previous else 1)

    def restart(self, name: str, extra_env: dict[str, str] | None = None) -> None:
        """Start ``name`` again, in a new actor on an alive node its placement allows (after it died
        or its node was lost), ``extra_env`` overriding some of its environment; the log is appended to."""
        old = self.procs[name]
        self.kill(name)
        ray.kill(old.actor, no_restart=True)
        comp = self._place(old.role, old.rank)
        comp.binds = old.binds
        if self.launcher.bind_host == "node" and old.binds and comp.where["ip"] != old.where["ip"]:
            ray.kill(comp.actor, no_restart=True)
            raise FleetError(
                f"{name} binds {', '.join(BOUND_BY[old.role])} at {old.where['ip']}, which running processes "
                f"are connected to; with launcher.bind_host node it can only restart on that node, and the only "
                f"node with room is {comp.where['ip']}: place {old.role} where it stays (placement.{old.role}.labels)"
            )
        comp.extra_env = {**old.extra_env, **(extra_env or {})}
        self._launch(name, comp, starts=old.starts + 1)

    def names(self, role: str) -> list[str]:
        return [n for n, c in self.procs.items() if c.role == role]

    def pid(self, name: str) -> int:
        """The PID of the component's process on its node."""
        return self.procs[name].pid

    def node(self, name: str) -> dict:
        """Where ``name`` runs now: node_id, ip, host (its bind address), the node's labels."""
        return dict(self.procs[name].where)

    def dead(self) -> dict[str, int]:
        """Components that exited with an error (name -> exit code) or whose actor is gone
        (name -> ``ActorLost``, naming the node)."""
        self._collect_exits()
        return {n: c.returncode for n, c in self.procs.items() if c.returncode not in (None, 0)}

    def exited(self, names: list[str]) -> bool:
        self._collect_exits(force=True)
        return all(self.procs[n].returncode is not None for n in names)

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (if it still runs) and wait for its exit status."""
        comp = self.procs[name]
        if comp.returncode is None:
            comp.signalled = True
            try:
                ray.get(comp.actor.signal.remote(signal.SIGKILL), timeout=30)
            except ray.exceptions.RayActorError:
                pass  # the actor is gone already, and with it the child
            self._settle(comp, timeout=30)

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop every component: TERM, KILL after ``timeout``; then release the actors, the placement
        group, and the Ray instance this fleet started (a cluster it joined keeps running). A later
        ``start`` reserves everything again."""
        if not self._open:
            return
        try:
            self._signal_all(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for comp in self.procs.values():
                self._settle(comp, timeout=max(0.1, deadline - time.monotonic()))
            self._signal_all(signal.SIGKILL)
            for comp in self.procs.values():
                self._settle(comp, timeout=10)
                if comp.returncode is None:  # no answer: its actor is killed below, and the child with it
                    comp.returncode = -signal.SIGKILL
        finally:
            for comp in [*self.procs.values(), *self.reserved.values()]:
                ray.kill(comp.actor, no_restart=True)
            self.reserved.clear()
            if self.learner_group is not None:
                remove_placement_group(self.learner_group)
                self.learner_group = None
            if self._owns_ray:
                ray.shutdown()
                self._owns_ray = False
            self._open = False

    # -- placement ---------------------------------------------------------------------------------

    def _reserve_learner_group(self):
        bundles, selectors = learner_bundles(self.placement.learner, self.learner_ranks)
        kwargs = {"bundle_label_selector": selectors} if selectors else {}
        group = placement_group(bundles, strategy=self.placement.learner_strategy, **kwargs)
        if not group.wait(timeout_seconds=self.launcher.placement_timeout_s):
            remove_placement_group(group)
            raise FleetError(
                f"no node can hold the learner's {self.learner_ranks} rank(s) ({bundles[0]} each, labels "
                f"{self.placement.learner.labels or 'any'}, {self.placement.learner_strategy}) within "
                f"{self.launcher.placement_timeout_s} s; the cluster has {_cluster_summary()}"
            )
        return group

    def _place(self, role: str, rank: int) -> Component:
        """A new actor for ``role`` on a node that satisfies its placement, once Ray has started it."""
        spec = getattr(self.placement, role)
        options = actor_options(spec)
        if role == "learner":
            options.pop("label_selector", None)  # the placement group's bundles carry the labels
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.learner_group, placement_group_bundle_index=rank
            )
        actor = ComponentActor.options(**options).remote()
        num_ports = len(BOUND_BY.get(role, ())) + (1 if role == "learner" else 0)  # + MASTER_PORT
        try:
            where = ray.get(
                actor.locate.remote(self.launcher.bind_host, num_ports), timeout=self.launcher.placement_timeout_s
            )
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise FleetError(
                f"no alive node gave {role} {options.get('num_cpus')} CPU, {options.get('num_gpus')} GPU with labels "
                f"{spec.labels or 'any'} within {self.launcher.placement_timeout_s} s; the cluster has "
                f"{_cluster_summary()}"
            ) from None
        return Component(role=role, rank=rank, actor=actor, where=where)

    def _bind_on_nodes(self) -> None:
        """Move each reserved role's bound addresses to its node (``bind_host: node``)."""
        self.endpoints = Endpoints.load(self.run_dir)
        fields = {}
        for role, comp in self.reserved.items():
            for name, port in zip(BOUND_BY[role], comp.where["ports"]):
                if getattr(self.endpoints, name) is not None:
                    fields[name] = f"tcp://{comp.where['host']}:{port}"
        self.endpoints = self.endpoints.model_copy(update=fields)
        tmp = self.run_dir / "endpoints.json.tmp"
        tmp.write_text(self.endpoints.model_dump_json(indent=2))
        os.replace(tmp, self.run_dir / "endpoints.json")  # readers never see half a file

    def _launch(self, name: str, comp: Component, starts: int) -> None:
        env = {**self.settings, **comp.extra_env}
        if comp.role == "learner" and self.launcher.bind_host == "node":
            # Rank 0's node and a port free there are every rank's rendezvous (STRICT_PACK: one node).
            if comp.rank == 0:
                self.master = {"MASTER_ADDR": comp.where["host"], "MASTER_PORT": str(comp.where["ports"][-1])}
            env.update(self.master)
        cmd = self.command(comp.role, name)
        log_path = str(self.run_dir / "logs" / f"{name}.log")
        comp.starts = starts
        try:
            comp.pid = ray.get(comp.actor.start.remote(cmd, env, os.getcwd(), log_path, starts > 1), timeout=60)
        except ray.exceptions.RayActorError as e:
            raise FleetError(f"{name}: its actor on {comp.where['ip']} died before the process started: {e}") from e
        comp.exit_ref = comp.actor.wait.remote()
        self.procs[name] = comp
        self.history.append({"name": name, "role": comp.role, "start": starts, **comp.where, "pid": comp.pid})
        (self.run_dir / "placement.json").write_text(json.dumps(self.history, indent=1))

    def command(self, role: str, name: str) -> list[str]:
        """Arguments of the node's Python that run component ``name``."""
        return ["-m", "asyncrl.fleet.child", role, name, str(self.run_dir), str(self.model_dir)]

    # -- exits ------------------------------------------------------------------------------------

    def _collect_exits(self, force: bool = False) -> None:
        """Record the exit status of every component that ended since the last look (cheap: at most
        one non-blocking ``ray.wait`` per ``DEAD_POLL_S``)."""
        now = time.monotonic()
        if not force and now - self._checked_at < DEAD_POLL_S:
            return
        self._checked_at = now
        running = {c.exit_ref: c for c in self.procs.values() if c.returncode is None}
        if not running:
            return
        ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0, fetch_local=True)
        for ref in ready:
            self._record_exit(running[ref])

    def _settle(self, comp: Component, timeout: float) -> None:
        if comp.returncode is None:
            ready, _ = ray.wait([comp.exit_ref], timeout=timeout)
            if ready:
                self._record_exit(comp)

    def _record_exit(self, comp: Component) -> None:
        """The child's exit code; ``ActorLost`` when its actor is gone, or when a signal nobody here
        sent ended it while its node was going down (a node shutting down stops its workers and
        their children before Ray declares the node dead: watch for a few seconds)."""
        try:
            rc = ray.get(comp.exit_ref)
        except ray.exceptions.RayActorError:
            rc = None
        node_id = comp.where["node_id"]
        if rc is not None and (rc >= 0 or comp.signalled):
            comp.returncode = rc
            return
        deadline = time.monotonic() + LOSS_WATCH_S
        while rc is not None and time.monotonic() < deadline:
            if _node_gone(node_id) or not _answers(comp.actor):
                rc = None
            else:
                time.sleep(0.2)
        if rc is not None:  # killed by a signal on a node that lives on: an ordinary death
            comp.returncode = rc
            return
        comp.returncode = ActorLost(node_id, comp.where["ip"], node_died=_node_gone(node_id, wait_s=LOSS_WATCH_S))
        log.warning("%s %s", comp.role, comp.returncode)

    def _signal_all(self, signum: int) -> None:
        running = [c for c in self.procs.values() if c.returncode is None]
        for comp in running:
            comp.signalled = True
        refs = [c.actor.signal.remote(signum) for c in running]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # gone with its node: nothing left to signal


def _answers(actor: ray.actor.ActorHandle) -> bool:
    """Whether the actor still answers (within 2 s)."""
    try:
        ray.get(actor.signal.remote(0), timeout=2)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def _node_gone(node_id: str, wait_s: float = 0.0) -> bool:
    """Whether Ray declares the node dead, waiting a little: a node shutting down is declared dead
    shortly after its workers are gone."""
    deadline = time.monotonic() + wait_s
    while True:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _cluster_summary() -> str:
    """Alive nodes with their resources and labels, for error messages."""
    nodes = [n for n in ray.nodes() if n["Alive"]]
    return "; ".join(
        f"{n['NodeManagerAddress']} { ({k: v for k, v in n['Resources'].items() if k in ('CPU', 'GPU')}) } "
        f"labels { ({k: v for k, v in n.get('Labels', {}).items() if not k.startswith('ray.io/')}) }"
        for n in nodes
    )
