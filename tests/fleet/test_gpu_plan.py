"""The local launcher's GPU plan: each process's CUDA_VISIBLE_DEVICES, checked before anything
starts, and shown as a table (at start and by show-config). Device counts are given, never probed."""

import os
import stat
import sys

import pytest
from pydantic import ValidationError

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.controller.lifecycle import Lifecycle
from asyncrl.controller.reports import ProcessReports, TrainingProgress
from asyncrl.fleet.gpu_plan import Devices, GpuRequest, gpu_plan, node_devices, pack
from asyncrl.fleet.local import ProcessFleet
from asyncrl.wire.messages import ReadyEvent

ONE_GPU_BOX = [
    "run.num_generators=1",
    "placement.generator.num_gpus=0.5",
    "placement.learner.num_gpus=0.5",
    "engine.kv_cache_memory_bytes=null",
    "engine.gpu_memory_utilization=0.45",
]


class Commands:
    def broadcast(self, message):
        pass


class ExitedAsReady:
    """Says each started process is ready once it has exited (its output then complete)."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.told: set[str] = set()

    def next(self, deadline, what):
        for name, proc in self.fleet.procs.items():
            if name not in self.told:
                proc.wait(timeout=30)
                self.told.add(name)
                return ReadyEvent(source=name)
        raise AssertionError(f"more events asked for than processes started, waiting for {what}")


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    """A local fleet whose children, instead of a component, print their CUDA_VISIBLE_DEVICES
    (``unset`` when they have none) into their log."""
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "${CUDA_VISIBLE_DEVICES-unset}"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(python))
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return ProcessFleet(tmp_path, tmp_path, env)


def lifecycle(cfg, fleet):
    """The controller's start path over ``fleet``: only what starting the processes touches."""
    from asyncrl.controller.phases import PhaseClock
    from asyncrl.controller.supervision import Supervisor
    from asyncrl.fleet.config import SupervisionConfig

    none = dict.fromkeys(("checkpoints", "evaluations", "watch", "timeline", "ledger"))
    reports, progress = ProcessReports(), TrainingProgress()
    return Lifecycle(
        cfg=cfg,
        run_dir=fleet.run_dir,
        fleet=fleet,
        commands=Commands(),
        pump=ExitedAsReady(fleet),
        reports=reports,
        progress=progress,
        supervisor=Supervisor(SupervisionConfig(), fleet.run_dir, reports, progress),  # the start arms it
        phases=PhaseClock(),
        **none,
    )


def seen(fleet) -> dict[str, list[str]]:
    """What each child printed, one line per start."""
    return {name: (fleet.run_dir / "logs" / f"{name}.log").read_text().split() for name in fleet.procs}


def test_each_process_starts_and_restarts_with_its_own_devices(fleet, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")  # the controller's: plan indices 0,1,2 are these
    cfg = load_config(
        None,
        [
            "launcher.gpus=3",
            "learner.ranks=2",
            "placement.learner.num_gpus=1",
            "run.num_generators=2",
            "placement.generator.num_gpus=0.5",
        ],
    )
    lifecycle(cfg, fleet).start_all(None)
    fleet.restart("generator-1")
    fleet.procs["generator-1"].wait(timeout=30)
    assert seen(fleet) == {
        "buffer": [],  # set but empty: it asked for no GPU, so it sees none
        "reward-0": [],
        "dispatcher": [],
        "learner": ["4,5"],  # ranks own one device each and see the group's in rank order
        "learner-1": ["4,5"],
        "generator-0": ["6"],  # two halves share the third device
        "generator-1": ["6", "6"],  # a restart keeps its devices
    }


def test_no_gpu_asked_sets_nothing(fleet):
    cfg = load_config(None, ["run.num_generators=1"])
    assert gpu_plan(cfg) is None
    lifecycle(cfg, fleet).start_all(None)
    assert seen(fleet) == dict.fromkeys(["buffer", "reward-0", "dispatcher", "learner", "generator-0"], ["unset"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["launcher.gpus=1", "placement.generator.num_gpus=1", "placement.learner.num_gpus=0.5"],
            r"the GPUs the run asks for \(2.5 in all\) do not fit the 1 of this machine \(launcher.gpus\): "
            r"learner 1 x 0.5 GPU \(placement.learner.num_gpus: learner\); "
            r"generator 2 x 1 GPU \(placement.generator.num_gpus: generator-0, generator-1\); rule: whole-GPU",
        ),
        (["launcher.gpus=0", "placement.reward.num_gpus=1"], r"do not fit the 0 of this machine"),
        (["launcher.gpus=1", "learner.ranks=2", "placement.learner.num_gpus=0.5"], r"one learner rank per device"),
        (["launcher.gpus=2", "placement.learner.num_gpus=2"], r"learner.num_gpus \(2\) must be at most 1"),
    ],
)
def test_a_plan_that_does_not_fit_fails_before_any_process_starts(fleet, overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError, match=message):
        lifecycle(cfg, fleet).start_all(None)
    assert fleet.procs == {}


def test_fractions_share_a_device_and_the_table_says_who_and_how_much():
    cfg = load_config(None, ONE_GPU_BOX)
    plan = gpu_plan(cfg, Devices(("0",), (80.0,), "test"))
    assert plan.env("generator-0") == plan.env("learner") == {"CUDA_VISIBLE_DEVICES": "0"}
    assert plan.env("buffer") == {"CUDA_VISIBLE_DEVICES": ""}
    table = plan.table()
    assert "GPU 0 shared: learner + generator-0 (1 of 1)" in table
    row = next(line.split() for line in table.splitlines() if line.strip().startswith("generator-0"))
    assert row[:4] == ["generator-0", "generator", "0", "0.5"]
    assert "engine.gpu_memory_utilization 0.45 x device = 36.0 GiB" in table
    assert "share 0.5 x device = 40.0 GiB" in table


def test_whole_requests_take_whole_devices_first_and_fractions_fill_the_rest_largest_first():
    asks = [
        GpuRequest(*a)
        for a in [("a", "reward", 0.25), ("b", "generator", 0.5), ("c", "generator", 1.0), ("d", "reference", 0.75)]
    ]
    assert pack(asks, 3) == {"a": (1,), "b": (2,), "c": (0,), "d": (1,)}
    assert pack(asks, 2) is None
    ranks = [GpuRequest("learner", "learner", 0.5), GpuRequest("learner-1", "learner", 0.5)]
    assert pack(ranks, 2) == {"learner": (0,), "learner-1": (1,)}  # halves, yet one rank per device


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "placement.generator.num_gpus=0.5",
                "engine.kv_cache_memory_bytes=null",
                "engine.gpu_memory_utilization=0.9",
            ],
            r"engine.gpu_memory_utilization \(0.9\) must be at most placement.generator.num_gpus \(0.5\)",
        ),
        (
            ["placement.generator.num_gpus=0.5", "engine.tensor_parallel_size=2"],
            r"num_gpus \(0.5\) must equal engine.tensor_parallel_size \(2\)",
        ),
        (["launcher.kind=ray", "launcher.gpus=2"], r"launcher.gpus \(2\) is for launcher.kind local"),
    ],
)
def test_config_rules_of_gpu_shares_name_the_values(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, overrides)


def test_the_controllers_own_devices_name_the_plans_and_bound_the_count():
    assert node_devices(2, {"CUDA_VISIBLE_DEVICES": "3,1,2"}).ids == ("3", "1")
    assert node_devices(2, {}).ids == ("0", "1")
    with pytest.raises(ValueError, match=r"launcher.gpus \(2\) must be at most the 1 device\(s\).*\(7\)"):
        node_devices(2, {"CUDA_VISIBLE_DEVICES": "7"})


def test_show_config_prints_the_plan(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("launcher: {gpus: 1}\n")
    assert main(["show-config", str(recipe), *ONE_GPU_BOX]) == 0
    out = capsys.readouterr().out
    assert "# GPU plan (1 GPU(s), launcher.gpus;" in out and "# " + "  GPU 0 shared: learner + generator-0" in out
    assert main(["show-config", str(recipe), "placement.learner.num_gpus=2"]) == 2
    assert "learner.num_gpus (2) must be at most 1" in capsys.readouterr().err
