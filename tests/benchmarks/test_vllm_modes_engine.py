"""The four-combination benchmark end to end on a real vLLM engine (CPU build), at a tiny size:
every answer has its drawn length, the sync combinations train at staleness 0, and the JSON
carries each combination's figures and the split of the gain."""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.benchmarks.vllm_modes import COMBINATIONS, run_modes_bench  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine and four short runs (~1 min)


def test_four_combinations_on_a_real_engine(tmp_path):
    overrides = ["n=2", "bound=8", "batch_groups=2", "max_staleness=1", "warmup_steps=1", "steps=2", "alone_groups=4"]
    result = run_modes_bench("configs/bench_vllm_modes.yaml", overrides, tmp_path)
    assert json.loads((tmp_path / "pipeline_vllm_modes.json").read_text())["commit"] == result["commit"]
    assert set(result["combinations"]) == {f"{t}-{m}" for t, m in COMBINATIONS}
    for name, combo in result["combinations"].items():
        assert combo["trained_tokens_per_s"] > 0 and combo["generator"]["occupancy"] > 0, name
        assert sum(combo["staleness_hist"].values()) == 2 * 2 * 2  # steps x groups x n, after the fill
        if name.startswith("sync"):
            assert set(combo["staleness_hist"]) == {0} and combo["versions_per_sample"] == {1: 8}, name
        else:
            assert max(combo["staleness_hist"]) <= 1 and combo["dropped_stale_groups"] == 0, name
    assert result["combinations"]["async-batch"]["versions_per_sample"] == {1: 8}  # swaps between batches only
    assert set(result["tokens_per_s_by_sequences_running"]) == {2, 4, 8}  # k = n, 2n, ... up to the bound
    split = result["gain_split"]
    assert split["continuous_batching"] * split["overlap"] == pytest.approx(result["async_continuous_over_sync_batch"])
