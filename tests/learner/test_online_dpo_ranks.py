"""Two learner ranks train online DPO exactly as one rank on the whole batch (gloo, CPU).

Each case (``online_dpo_rank_worker.CASES``: DPO at ZeRO-2, IPO on every best x worst pair with
two epochs of two mini-batches at ZeRO-3, the hinge with the NLL term on packed micro batches)
runs two steps on the same ragged batch of 5 groups, once in a group of one process and once in
a group of two whose ranks get 3 and 2 groups. The weights and the step's figures must agree to
float32 rounding (tolerances as ``test_ranks``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.fleet.launcher import learner_rank_env
from asyncrl.wire.endpoints import free_ports
from tests.learner.online_dpo_rank_worker import CASES, FIGURES

pytestmark = pytest.mark.slow

WORKER_TIMEOUT_S = 300
"""Seconds one world may take for every case."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64), out)


def run_world(ranks: int, model_dir: Path, out_dir: Path, cases: list[str]) -> None:
    """Run ``cases`` in a learner group of ``ranks`` processes, as the launcher starts them."""
    out_dir.mkdir()
    procs = []
    for env in learner_rank_env(ranks, free_ports(1)[0]):
        cmd = [sys.executable, "-m", "tests.learner.online_dpo_rank_worker", str(model_dir), str(out_dir), *cases]
        procs.append(subprocess.Popen(cmd, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}))
    try:
        codes = [p.wait(timeout=WORKER_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * ranks, f"rank exit codes {codes}"


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("worlds")
    cases = sorted(CASES)
    run_world(1, model_dir, root / "one", cases)
    run_world(2, model_dir, root / "two", cases)
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_train_online_dpo_as_one(case, results):
    one = torch.load(results / "one" / f"{case}.pt", weights_only=False)
    two = torch.load(results / "two" / f"{case}.pt", weights_only=False)
    assert (one["world"], two["world"]) == (1, 2)
    assert list(one["state"]) == list(two["state"])
    for name, before in one["state"].items():
        torch.testing.assert_close(two["state"][name], before, rtol=1e-4, atol=2e-5, msg=f"{case}: {name}")
    assert one["figures"]["dpo_pairs"] > 0
    for name in FIGURES:
        assert name in one["figures"], (case, name)
        assert two["figures"][name] == pytest.approx(one["figures"][name], rel=1e-4, abs=1e-6), (case, name)
