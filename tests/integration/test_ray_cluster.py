"""The simulated pipeline (simulated engines, every other process real) launched on a Ray cluster
of three nodes on this machine: placed by labels, trained to the end, every sample accounted for;
then the same with a node removed mid-run, whose components supervision restarts on a live node;
and the real pipeline (vLLM generators, a DeepSpeed learner of two ranks) over two nodes."""

from __future__ import annotations

import json
import threading

import pytest
import ray

from asyncrl.config import load_config
from asyncrl.controller.process import Controller
from tests.raycluster import local_cluster
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial("ray")]  # Ray clusters running whole runs (~2 min)

PLACED = [
    "launcher.kind=ray",
    "placement.buffer={num_cpus: 0.5, labels: {pool: main}}",
    "placement.dispatcher={num_cpus: 0.5, labels: {pool: main}}",
    "placement.learner={num_cpus: 1, labels: {pool: main}}",
    "sampling.max_tokens=64",
    "run.console=quiet",
]


MAIN_ROLES = ("learner", "buffer", "dispatcher", "reward")


def starts_by_name(run_dir) -> dict[str, list[dict]]:
    starts: dict[str, list[dict]] = {}
    for record in json.loads((run_dir / "placement.json").read_text()):
        starts.setdefault(record["name"], []).append(record)
    return starts


def test_a_toy_run_spread_over_three_nodes_binding_on_their_addresses_trains_and_reconciles(tmp_path):
    with local_cluster(
        head_cpus=3,
        head_labels={"pool": "main"},
        nodes=[{"num_cpus": 4, "labels": {"pool": "gen"}}, {"num_cpus": 1, "labels": {"pool": "cpu"}}],
    ) as cluster:
        cfg = load_config(
            "configs/bench_pipeline.yaml",
            [
                f"run.root={tmp_path}",
                "learner.total_steps=6",
                f"launcher.address={cluster.address}",
                *PLACED,
                "placement.generator={num_cpus: 1, labels: {pool: gen}}",
                "placement.reward={num_cpus: 1, labels: {pool: cpu}}",
                # As on several machines: each process binds on its node's address (here every
                # node's is 127.0.0.1, at ports its node chose), weights stream over ZeroMQ.
                "launcher.bind_host=node",
                "weights.transport=zmq",
            ],
        )
        summary = Controller(cfg).run()
    assert summary["learner_steps"] == 6 and summary["reconciles"], summary
    assert all(v == 0 for v in summary["unaccounted_by_link"].values())
    starts = starts_by_name(tmp_path / "bench")
    pools = {name: records[-1]["labels"]["pool"] for name, records in starts.items()}
    assert pools == {
        "buffer": "main",
        "dispatcher": "main",
        "learner": "main",
        "reward-0": "cpu",
        **{f"generator-{i}": "gen" for i in range(4)},
    }
    assert len({records[-1]["node_id"] for records in starts.values()}) == 3
    endpoints = json.loads((tmp_path / "bench" / "endpoints.json").read_text())
    for role, name in (("buffer", "buffer_in"), ("reward-0", "reward_in"), ("learner", "weights_stream")):
        assert endpoints[name].rsplit(":", 1)[1] in map(str, starts[role][0]["ports"])  # chosen on its node
    assert not summary["deaths"]


@ray.remote(num_cpus=2, label_selector={"spare": "yes"})
class Placeholder:
    """Holds the spare node's CPUs until the test frees them (an autoscaler's new node, in effect)."""


def test_a_run_survives_losing_a_node_with_its_generators_and_reward_worker(tmp_path):
    # The two gen nodes are full (three generators and the reward worker, one CPU each): the node
    # lost holds the reward worker and one generator; they restart on the spare node, freed then.
    with local_cluster(
        head_cpus=3,
        head_labels={"pool": "main"},
        nodes=[
            {"num_cpus": 2, "labels": {"pool": "gen"}},
            {"num_cpus": 2, "labels": {"pool": "gen"}},
            {"num_cpus": 2, "labels": {"pool": "gen", "spare": "yes"}},
        ],
    ) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        placeholder = Placeholder.remote()
        ray.get(placeholder.__ray_ready__.remote(), timeout=60)
        spare = next(n["NodeID"] for n in ray.nodes() if n["Labels"].get("spare"))
        cfg = load_config(
            "configs/bench_pipeline.yaml",
            [
                f"run.root={tmp_path}",
                "learner.total_steps=16",
                "run.num_generators=3",
                f"launcher.address={cluster.address}",
                *PLACED,
                "placement.generator={num_cpus: 1, labels: {pool: gen}}",
                "placement.reward={num_cpus: 1, labels: {pool: gen}}",
                "supervision.backoff_initial_s=0.2",
            ],
        )
        controller = Controller(cfg)
        lost: dict = {}

        def lose_the_reward_workers_node_at_step_4():
            wait_until(
                lambda: controller.progress.steps_seen >= 4 and controller.supervisor.training,
                "the learner's step 4, to remove the reward worker's node",
                timeout=600,
                interval=0.05,
            )
            fleet = controller.fleet
            lost["node_id"] = node_id = fleet.node("reward-0")["node_id"]
            lost["names"] = sorted(n for n in fleet.procs if fleet.node(n)["node_id"] == node_id)
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_id))
            ray.kill(placeholder)

        threading.Thread(target=lose_the_reward_workers_node_at_step_4, daemon=True).start()
        try:
            summary = controller.run()
        finally:
            ray.shutdown()
    assert summary["learner_steps"] == 16 and summary["reconciles"], summary
    ledger = summary["ledger"]
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, ledger
    assert len(lost["names"]) == 2 and "reward-0" in lost["names"], lost
    assert sorted(d["name"] for d in summary["deaths"]) == lost["names"]
    assert all(d["exit_code"] == -9 for d in summary["deaths"])  # lost with the node, as if SIGKILLed
    starts = starts_by_name(tmp_path / "bench")
    for name in lost["names"]:
        assert [r["node_id"] for r in starts[name]] == [lost["node_id"], spare], starts[name]


def test_real_vllm_generators_and_a_deepspeed_learner_of_two_ranks_on_two_nodes(tmp_path):
    with local_cluster(
        head_cpus=5, head_labels={"pool": "main"}, nodes=[{"num_cpus": 2, "labels": {"pool": "gen"}}]
    ) as c:
        cfg = load_config(
            "configs/demo.yaml",
            [
                f"run.root={tmp_path}",
                "run.name=vllm",
                "run.num_generators=2",
                "run.console=quiet",
                "learner.total_steps=4",
                "learner.ranks=2",  # one placement group, both bundles on the main node
                "learner.broadcast_every=2",
                "learner.batch_groups=4",
                "generator.prompts_per_batch=4",
                "sampling.n=4",
                "sft.steps=20",
                "eval.num_prompts=20",
                "launcher.kind=ray",
                f"launcher.address={c.address}",
                "placement.generator={num_cpus: 1, labels: {pool: gen}}",
                *(f"placement.{role}={{num_cpus: 1, labels: {{pool: main}}}}" for role in MAIN_ROLES),
            ],
        )
        summary = Controller(cfg).run()
    assert summary["learner_steps"] == 4 and summary["reconciles"], summary
    assert summary["generator_versions"] == {"generator-0": 4, "generator-1": 4}
    assert (tmp_path / "vllm" / "final" / "model.safetensors").exists()
    starts = starts_by_name(tmp_path / "vllm")
    assert {name: records[-1]["labels"]["pool"] for name, records in starts.items() if "generator" in name} == {
        "generator-0": "gen",
        "generator-1": "gen",
    }
    assert {starts[name][-1]["labels"]["pool"] for name in ("learner", "learner-1")} == {"main"}
