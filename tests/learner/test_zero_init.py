"""Under ZeRO-3 a learner rank never holds a whole model: its peak during construction is its
share of the parameters plus about one module, measured in fresh processes of two ranks (gloo).

The bound each rank's measured peak must stay under (``zero_init_worker``: the high-water mark
of its resident set above where it stood) is

    share + 3 x largest module + 5 % of the model

- ``share``: the bytes of the rank's own partitions (1/2 of the model);
- the largest module whole, three times over: gathered (``GatheredParameters``), the all-gather's
  and broadcast's buffers beside it, and on rank 0 the checkpoint tensor read into it;
- 5 % of the model for everything else that grows with it (allocator slack, DeepSpeed's
  per-parameter bookkeeping).

The same processes load the model the old way (``from_pretrained``, whole, fp32) and must
exceed the bound: the test can fail. The model is small but not tiny (26 M parameters,
~100 MB): the measured growths must stand clear of the few MB a process's resident set moves
by for reasons of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncrl.fleet.launcher import learner_rank_env
from asyncrl.wire.endpoints import free_ports

pytestmark = pytest.mark.slow

WORKER_TIMEOUT_S = 300
"""Seconds the two ranks may take for their three constructions (~10 s here)."""

RANKS = 2


def bound(figures: dict) -> float:
    """The most a rank may hold above its start while it builds the model partitioned."""
    return figures["share"] + 3 * figures["largest_module"] + 0.05 * figures["total"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    root = tmp_path_factory.mktemp("zero_init")
    shape = TinyModelConfig(
        hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536, tie_word_embeddings=True
    )
    model_dir = build_tiny_model(shape, root / "model")
    out = root / "out"
    out.mkdir()
    procs = []
    for env in learner_rank_env(RANKS, free_ports(1)[0]):
        cmd = [sys.executable, "-m", "tests.learner.zero_init_worker", str(model_dir), str(out)]
        procs.append(subprocess.Popen(cmd, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}))
    try:
        codes = [p.wait(timeout=WORKER_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * RANKS, f"rank exit codes {codes}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def test_each_rank_holds_its_share_plus_about_one_module_while_it_builds_the_model(measured):
    for figures in measured:
        assert figures["world"] == RANKS
        # the partitions are a half each (DeepSpeed pads each parameter to a multiple of the ranks)
        assert figures["total"] / RANKS <= figures["share"] <= figures["total"] / RANKS * 1.01
        assert figures["partitioned"] <= bound(figures), figures


def test_the_whole_model_on_each_rank_exceeds_that_bound(measured):
    for figures in measured:
        assert figures["full"] > bound(figures), figures


def test_the_critics_value_model_is_built_partitioned_too(measured):
    for figures in measured:
        assert figures["value_share"] <= figures["share"]  # the backbone without the LM head
        assert figures["value_model"] <= bound(figures), figures
