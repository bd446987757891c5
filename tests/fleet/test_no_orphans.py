"""A generator with a real vLLM engine (``AsyncLLM``: its engine core is a child process,
``VLLM::EngineCore``) is SIGKILLed: no process of its tree survives.

The generator is started as the controller starts it (``ProcessFleet``, the components'
environment), on the project's tiny model, with either start method of its engine core
(``engine.core_start_method``): ``fork`` (the default; a CPU) and ``spawn`` (what vLLM forces once
CUDA is initialised or inside a Ray actor). Its tree is read from /proc once the engine is ready;
after the kill nobody reaps or kills anything for a while, so what ends the engine core is its
own watch of its parent (``asyncrl.fleet.process_tree``); then the fleet finds the generator dead
(exit -9) and its group empty."""

from __future__ import annotations

import os
import signal
import time

import pytest

from asyncrl.config import load_config
from asyncrl.controller.preparation import child_env
from asyncrl.fleet import process_tree
from asyncrl.fleet.local import ProcessFleet
from tests.integration.harness import Harness

pytestmark = pytest.mark.slow  # a real vLLM engine (~30 s to start on this CPU)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])  # fork on a CPU, spawn once CUDA is up
def test_a_sigkilled_generator_leaves_no_process_of_its_tree(tmp_path, start_method):
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    model = build_tiny_model(TinyModelConfig(), tmp_path / "model")
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=orphans",
            f"model.path={model}",
            "generator.mode=continuous",
            f"engine.core_start_method={start_method}",
        ],
    )
    run_dir = tmp_path / "orphans"
    h = Harness(run_dir, cfg)  # writes the config and endpoints, and hears the generator's events
    fleet = ProcessFleet(run_dir, model, child_env(run_dir))
    tree: list[int] = []
    try:
        fleet.start("generator", "generator-0")
        pid = fleet.pid("generator-0")
        h.wait_for("generator-0", "ready", timeout=300)
        tree = process_tree.descendants(pid)
        cores = [p for p in tree if "EngineCore" in open(f"/proc/{p}/cmdline").read()]
        assert cores, f"no engine core among the generator's children {tree}: is the engine in-process?"
        assert all(os.getpgid(p) == pid for p in tree)  # every one in the generator's group

        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # the watch looks every 0.5 s
        while process_tree.alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_tree.alive(tree) == [], f"survivors of the generator's tree: {process_tree.alive(tree)}"
        assert fleet.dead() == {"generator-0": -signal.SIGKILL}
        assert process_tree.group_members(pid) == []
        # Nobody else killed them: the engine core's own watch of its parent ended the group.
        assert f"parent {pid} is gone: ending process group {pid}" in (run_dir / "logs" / "generator-0.log").read_text()
    finally:
        fleet.terminate(timeout=5)
        h.close()
        for p in process_tree.alive(tree):  # only if the test failed: never leave them running
            os.kill(p, signal.SIGKILL)
