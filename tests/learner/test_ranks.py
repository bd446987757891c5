"""Two learner ranks train exactly as one rank on the whole batch (gloo, CPU).

Each case (``rank_worker.CASES``: every aggregation mode, PPO with a critic, KL in the loss and in
the reward, several epochs and mini-batches with an entropy bonus, packed micro batches, the
batch-whitened REINFORCE++; at ZeRO stage 2, and those the stage changes at stages 1 and 3: see
``rank_worker.PER_STAGE``) runs two steps on the same ragged batch of
5 groups, once in a group of one process and once in a group of two whose ranks get 3 and 2
groups of different token counts and different numbers of micro batches. The weights after the
steps and the steps' figures must agree to float32 rounding. (Adam divides each element's
gradient by its own running RMS, so an element whose gradient is nearly 0 can turn rounding into a
visible step: the weights' tolerance is 2% of the learning rate, 1e-3.)
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
from tests.learner.rank_worker import CASES, FIGURES

pytestmark = pytest.mark.slow

WORKER_TIMEOUT_S = 900
"""Seconds one world may take for every case (about 40 trainers built and stepped twice)."""


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
        cmd = [sys.executable, "-m", "tests.learner.rank_worker", str(model_dir), str(out_dir), *cases]
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
def test_two_ranks_train_as_one_on_the_whole_batch(case, results):
    one = torch.load(results / "one" / f"{case}.pt", weights_only=False)
    two = torch.load(results / "two" / f"{case}.pt", weights_only=False)
    assert (one["world"], two["world"]) == (1, 2)
    assert list(one["state"]) == list(two["state"])
    moved = 0
    for name, before in one["state"].items():
        torch.testing.assert_close(two["state"][name], before, rtol=1e-4, atol=2e-5, msg=f"{case}: {name}")
        moved += 1
    assert moved > 0
    for name in FIGURES:
        if name in one["figures"]:
            assert two["figures"][name] == pytest.approx(one["figures"][name], rel=1e-4, abs=1e-6), (case, name)
