"""The launcher section: local by default with no Ray imported, ``launcher: ray`` as shorthand,
and the rules that tie placement to the rest of the run."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from asyncrl.config import load_config
from asyncrl.fleet.config import LauncherConfig
from asyncrl.fleet.launcher import binding_roles, controller_host, make_fleet
from asyncrl.fleet.local import ProcessFleet
from asyncrl.wire.endpoints import Endpoints


def test_the_local_launcher_is_the_default_and_needs_no_ray(tmp_path):
    cfg = load_config(None)
    assert cfg.launcher.kind == "local" and controller_host(cfg.launcher) == "127.0.0.1"
    assert isinstance(make_fleet(cfg, tmp_path, tmp_path, {}), ProcessFleet)
    code = "import sys; from asyncrl.controller.process import Controller; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_launcher_ray_is_short_for_kind_ray_and_dotted_keys_reach_it():
    assert load_config(None, ["launcher=ray"]).launcher == LauncherConfig(kind="ray")
    cfg = load_config(
        None,
        ["launcher.kind=ray", "launcher.address=10.0.0.1:6379", "launcher.bind_host=node", "weights.transport=zmq"],
    )
    assert (cfg.launcher.address, cfg.launcher.bind_host) == ("10.0.0.1:6379", "node")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["launcher.bind_host=node"], r"bind_host \('node'\) must be 127.0.0.1 with launcher.kind local"),
        (["launcher.kind=ray", "launcher.bind_host=node"], r"weights.transport \(shm\) shares /dev/shm of one host"),
        (["placement.generator.count=3"], r"placement.generator.count \(3\) must equal the 2 that run.num_generators"),
        (["placement.learner.count=2"], r"placement.learner.count \(2\) must equal the 1 that learner.ranks starts"),
        (["placement.generator.num_gpus=2"], r"num_gpus \(2.0\) must equal engine.tensor_parallel_size \(1\)"),
        (["placement.reward.num_gpus=1.5"], r"num_gpus \(1.5\) above 1 must be a whole number"),
        (["placement.critic={num_cpus: 1}"], r"critic"),
    ],
)
def test_placement_rules_name_the_value_and_the_rule(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, overrides)


def test_a_multi_host_run_streams_weights_and_binds_on_nodes():
    cfg = load_config(
        None,
        [
            "launcher.kind=ray",
            "launcher.bind_host=node",
            "weights.transport=zmq",
            "engine.tensor_parallel_size=2",
            "placement.generator={num_gpus: 2, labels: {pool: gpu}}",
            "algorithm.kl.coef=0.01",
            "algorithm.kl.reference=process",
        ],
    )
    assert cfg.placement.generator.labels == {"pool": "gpu"}
    assert binding_roles(cfg) == ["buffer", "reward", "dispatcher", "learner", "reference"]


def test_endpoints_allocate_on_a_given_host():
    assert Endpoints.allocate().events.startswith("tcp://127.0.0.1:")
    assert all(addr.startswith("tcp://127.0.0.1:") for addr in Endpoints.allocate("127.0.0.1").model_dump().values())
