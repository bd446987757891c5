"""Two learner ranks with ``sequence_parallel: 2`` train exactly as one rank (gloo, CPU).

Each case (``sequence_worker.CASES``: padded and packed micro batches, ZeRO stages 0 to 3, a KL
reference, per-sequence aggregation, GSPO's sequence-level ratio over several updates, gradient
checkpointing, ZeRO-3 with a partitioned LM head) scores a ragged batch of 5 groups (rows of 4 to 17 tokens: odd lengths are padded
to the shards) and trains two steps on it, once in a group of one process and once in a
sequence-parallel group of two whose ranks each run half of every row's positions (two of them
also on four ranks: two data-parallel groups of two; the partitioned head also on two
data-parallel ranks without sequence parallelism). The model has
4 query heads and 1 KV head, so the KV head is repeated for the two ranks. The scores before
training, the step's figures and the weights after both steps must agree to float32 rounding, as
the data-parallel equality tests (``test_ranks.py``) demand: rtol 1e-4 on the values, and on the
weights atol 2e-5, 2% of the learning rate (Adam turns an element's rounding-level gradient into
a step of up to the learning rate).
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
from tests.learner.rank_worker import FIGURES
from tests.learner.sequence_worker import CASES

pytestmark = pytest.mark.slow

WORKER_TIMEOUT_S = 600
"""Seconds one world may take for every case (five trainers built and stepped twice)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    shape = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=64)
    build_tiny_model(shape, root / "tiny")
    build_tiny_model(shape.model_copy(update={"vocab_size": 4096}), root / "wide")
    return root


def run_world(ranks: int, sequence_parallel: int, model_dir: Path, out_dir: Path, cases: list[str]) -> None:
    """``cases`` in a learner group of ``ranks`` processes, as the launcher starts them."""
    out_dir.mkdir()
    procs = []
    for env in learner_rank_env(ranks, free_ports(1)[0]):
        cmd = [sys.executable, "-m", "tests.learner.sequence_worker", str(model_dir), str(out_dir)]
        cmd += [str(sequence_parallel), *cases]
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
    run_world(1, 1, model_dir, root / "one", sorted(CASES))
    run_world(2, 2, model_dir, root / "two", sorted(CASES))
    run_world(4, 2, model_dir, root / "four", DATA_AND_SEQUENCE)
    run_world(2, 1, model_dir, root / "data", DATA_ONLY)
    return root


DATA_AND_SEQUENCE = ["z2-packed-entropy", "z3-seq-mean-token-mean-kl"]
"""Cases also run on four ranks: two data-parallel ranks of two sequence-parallel ranks each
(uneven shares of the batch, fillers, the reference's rows summed over both groups)."""

DATA_ONLY = ["z3-partitioned-head"]
"""Cases also run on two data-parallel ranks without sequence parallelism: each rank's micro
batches score a different number of positions, so the ranks need different numbers of calls of
the partitioned LM head, which they must still make equally often."""

WORLDS = {"two": (2, 2), "four": (4, 2), "data": (2, 1)}
"""World name -> (ranks, sequence_parallel)."""


@pytest.mark.parametrize(
    "case, world",
    [(case, "two") for case in sorted(CASES)]
    + [(case, "four") for case in DATA_AND_SEQUENCE]
    + [(case, "data") for case in DATA_ONLY],
)
def test_sequence_parallel_trains_as_one_rank(case, world, results):
    one = torch.load(results / "one" / f"{case}.pt", weights_only=False)
    two = torch.load(results / world / f"{case}.pt", weights_only=False)
    assert (one["world"], two["world"], two["sequence_parallel"]) == (1, *WORLDS[world])
    mask = one["mask"].bool()
    assert mask.sum() > 0
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(two[name][mask], one[name][mask], rtol=1e-4, atol=1e-5, msg=f"{case}: {name}")
    assert list(one["state"]) == list(two["state"])
    for name, before in one["state"].items():
        torch.testing.assert_close(two["state"][name], before, rtol=1e-4, atol=2e-5, msg=f"{case}: {name}")
    for name in FIGURES:
        if name in one["figures"]:
            assert two["figures"][name] == pytest.approx(one["figures"][name], rel=1e-4, abs=1e-6), (case, name)
