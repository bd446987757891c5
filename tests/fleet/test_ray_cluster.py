"""RayFleet on a three-node Ray cluster of this machine: placement by resources and labels, a
learner's ranks kept on one node, exit codes, node loss and restart elsewhere, addresses on nodes.

The components here are stand-ins (a Python one-liner that sleeps, then exits with a code from its
environment): these tests check where and how the fleet runs processes, not what they do."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray

from asyncrl.fleet.config import LauncherConfig, PlacementConfig, RolePlacement
from asyncrl.fleet.ray_cluster import ActorLost, FleetError, RayFleet
from asyncrl.wire.endpoints import Endpoints
from tests.raycluster import local_cluster
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial("ray")]  # a three-node Ray cluster (~1 min)

STAND_IN = (
    "import os, sys, time; print('settings', os.environ.get('ASYNCRL_TEST'), os.environ.get('MASTER_ADDR'), "
    "os.environ.get('DS_ACCELERATOR'), flush=True); time.sleep(float(os.environ.get('SLEEP_S', 600))); "
    "sys.exit(int(os.environ.get('EXIT_CODE', 0)))"
)


class StandInFleet(RayFleet):
    def command(self, role: str, name: str) -> list[str]:
        return ["-c", STAND_IN]


PLACEMENT = PlacementConfig(
    generator=RolePlacement(num_cpus=1, labels={"pool": "gen"}),
    reward=RolePlacement(num_cpus=0.5, labels={"pool": "gen"}),
    buffer=RolePlacement(num_cpus=0.5, labels={"pool": "main"}),
    dispatcher=RolePlacement(num_cpus=0.5, labels={"pool": "main"}),
    learner=RolePlacement(count=2, num_cpus=1, labels={"pool": "main"}),
)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(
        head_cpus=3,
        head_labels={"pool": "main"},
        nodes=[{"num_cpus": 2, "labels": {"pool": "gen"}}, {"num_cpus": 2, "labels": {"pool": "gen"}}],
    ) as c:
        yield c


def make_fleet(tmp_path, cluster, bind_host="127.0.0.1", placement=PLACEMENT, timeout=60.0, endpoints=None):
    (endpoints or Endpoints.allocate()).save(tmp_path)
    launcher = LauncherConfig(kind="ray", address=cluster.address, bind_host=bind_host, placement_timeout_s=timeout)
    return StandInFleet(
        tmp_path,
        tmp_path / "model",
        {"ASYNCRL_TEST": "yes"},
        launcher,
        placement,
        ["buffer", "reward", "learner"],
        learner_ranks=placement.learner.count or 1,
    )


def wait_for_text(path, text: str, timeout: float = 180) -> bool:
    """Whether ``text`` appears in the file at ``path`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.1)
    return False


def labels_of(node_id: str) -> dict:
    return next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)


def test_components_land_on_nodes_their_placement_allows_and_learner_ranks_share_a_node(tmp_path, cluster):
    fleet = make_fleet(tmp_path, cluster)
    try:
        fleet.start("buffer", "buffer")
        fleet.start("reward", "reward-0", {"EXIT_CODE": "3", "SLEEP_S": "0"})
        for rank in (0, 1):
            fleet.start("learner", f"learner-{rank}", {"RANK": str(rank), "MASTER_ADDR": "127.0.0.1"})
        for i in range(3):
            fleet.start("generator", f"generator-{i}")
        nodes = {name: fleet.node(name)["node_id"] for name in fleet.procs}
        assert all(labels_of(nodes[f"generator-{i}"])["pool"] == "gen" for i in range(3))
        assert labels_of(nodes["buffer"])["pool"] == "main" and labels_of(nodes["reward-0"])["pool"] == "gen"
        assert nodes["learner-0"] == nodes["learner-1"]  # one placement group, STRICT_PACK
        assert fleet.names("learner") == ["learner-0", "learner-1"] and fleet.roles["buffer"] == "buffer"

        # A component that exits with an error is reported by its exit code; the rest run on.
        wait_until(lambda: "reward-0" in fleet.dead(), "reward-0's exit to be reported", timeout=60, interval=0.1)
        assert fleet.dead() == {"reward-0": 3} and not fleet.exited(["buffer"])
        os.kill(fleet.pid("generator-2"), signal.SIGKILL)  # its node lives on: an ordinary death
        wait_until(
            lambda: "generator-2" in fleet.dead(), "generator-2's death to be reported", timeout=60, interval=0.1
        )
        rc = fleet.dead()["generator-2"]
        assert rc == -signal.SIGKILL and not isinstance(rc, ActorLost)
        # The controller's settings arrive; DeepSpeed's device is decided on the node.
        log = tmp_path / "logs" / "generator-0.log"
        # (MASTER_ADDR is whatever the node's environment holds: earlier tests in this process may set it.)
        assert wait_for_text(log, "settings yes "), log.read_text() if log.exists() else "no log"
        assert log.read_text().split("settings yes ", 1)[1].split()[1] == "cpu"
        recorded = json.loads((tmp_path / "placement.json").read_text())
        assert {r["name"] for r in recorded} == set(fleet.procs)
    finally:
        fleet.terminate()
    assert fleet.exited(list(fleet.procs))
    assert not ray.is_initialized()  # the fleet joined the cluster and left it; the cluster runs on
    assert len([n for n in cluster.list_all_nodes()]) == 3


def test_a_lost_node_is_reported_with_its_components_which_restart_on_a_live_node(tmp_path, cluster):
    doomed = cluster.add_node(num_cpus=2, labels={"pool": "gen"}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    fleet = make_fleet(tmp_path, cluster)
    try:
        for i in range(5):  # 5.5 CPUs free on the gen nodes: at least one lands on the doomed node
            fleet.start("generator", f"generator-{i}")
        on_doomed = [n for n in fleet.names("generator") if fleet.node(n)["node_id"] == doomed.node_id]
        assert on_doomed, {n: fleet.node(n)["node_id"][:8] for n in fleet.procs}
        cluster.remove_node(doomed)
        wait_until(
            lambda: set(fleet.dead()) == set(on_doomed), f"{on_doomed} to be reported lost", timeout=60, interval=0.1
        )
        dead = fleet.dead()
        assert set(dead) == set(on_doomed)
        for rc in dead.values():
            assert isinstance(rc, ActorLost) and rc.node_died and rc.node_id == doomed.node_id and rc == -9

        # A node with room: the restarted generators land there, their placement still respected.
        spare = cluster.add_node(num_cpus=2, labels={"pool": "gen"}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        for name in on_doomed:
            fleet.restart(name, {"ASYNCRL_TEST": "again"})
            assert fleet.node(name)["node_id"] == spare.node_id
        assert fleet.dead() == {}
        assert wait_for_text(tmp_path / "logs" / f"{on_doomed[0]}.log", "settings again")
        starts = [
            r["start"] for r in json.loads((tmp_path / "placement.json").read_text()) if r["name"] == on_doomed[0]
        ]
        assert starts == [1, 2]
    finally:
        fleet.terminate()
    cluster.remove_node(spare)


def test_with_bind_host_node_the_binding_roles_addresses_move_to_their_nodes(tmp_path, cluster):
    before = Endpoints.allocate()
    fleet = make_fleet(tmp_path, cluster, bind_host="node", endpoints=before)
    try:
        after = Endpoints.load(tmp_path)
        assert (after.events, after.control) == (before.events, before.control)  # the controller's own
        for name in ("buffer_in", "buffer_requests", "buffer_status", "reward_in", "reward_share", "weights"):
            assert getattr(after, name).startswith("tcp://127.0.0.1:")  # these nodes' address
        assert len({after.buffer_in, after.reward_in, after.weights, before.buffer_in}) == 4  # ports chosen there
        fleet.start("learner", "learner", {"RANK": "0", "MASTER_ADDR": "controller-host"})
        # Rank 0's node is the rendezvous, not the controller's MASTER_ADDR.
        assert wait_for_text(tmp_path / "logs" / "learner.log", "settings yes 127.0.0.1 cpu")
    finally:
        fleet.terminate()


def test_a_role_no_node_can_hold_fails_naming_what_it_asked_for(tmp_path, cluster):
    placement = PLACEMENT.model_copy(update={"buffer": RolePlacement(num_cpus=1, labels={"pool": "tpu"})})
    with pytest.raises(FleetError, match=r"buffer .*tpu.* within 3.0 s"):
        make_fleet(tmp_path, cluster, placement=placement, timeout=3.0)
    assert not ray.is_initialized()  # what it had reserved is released
