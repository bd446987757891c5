"""vLLM's native weight-transfer API on the CPU build: what docs/reference/weights.md says of it.

Its built-in data planes need CUDA, so asyncrl keeps its own transports; its protocol (start,
update, finish with a version) runs here with a backend registered from outside vLLM whose
``update_weights`` skips the base class's accelerator sync. If a later vLLM lifts either limit,
these tests fail and the page, and the choice, must be revisited. The registered backend lives in
``bench/vllm_weight_transfer.py``, loaded from there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a registered backend must be in this process

import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vllm_weight_transfer.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("vllm_weight_transfer", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = load_bench()
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU build's limits")


def test_native_trainer_engines_stop_before_any_call_without_cuda():
    nccl, ipc = bench.trainer_side("nccl"), bench.trainer_side("ipc")
    assert not nccl["ok"] and "Cannot access accelerator device" in nccl["error"], nccl
    assert not ipc["ok"] and "Cannot access accelerator device" in ipc["error"], ipc
    # nccl asks the engine to join (on a side thread) as it opens its own end; ipc asks nothing
    assert nccl["client_calls"] == ["init"] and ipc["client_calls"] == []


def test_native_engine_side_stops_at_init_for_nccl_and_at_the_first_update_for_ipc():
    for backend in ("nccl", "sparse_nccl"):
        out = bench.engine_side_stub(backend)
        assert out["stage"] == "init_weight_transfer_engine" and not out["ok"], out
        assert "Cannot access accelerator device" in out["error"], out
    ipc = bench.engine_side_stub("ipc")
    assert ipc["stage"] == "update_weights" and not ipc["ok"] and "CUDA" in ipc["error"], ipc


def test_the_base_update_weights_needs_an_accelerator_so_a_cpu_backend_overrides_it():
    """The base class ends every update with ``torch.accelerator.synchronize()``, which a process
    without an accelerator refuses (checked in a fresh one: a test process may have set one up)."""
    code = "import torch; torch.accelerator.synchronize()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Cannot access accelerator device" in done.stderr, done.stderr[-2000:]
    assert bench.FileTransferEngine.update_weights is not bench.WeightTransferEngine.update_weights


@pytest.mark.slow  # a vLLM engine (~10 s)
def test_the_native_protocol_serves_new_weights_through_a_registered_backend():
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="native_wt_"))
    model_a = build_tiny_model(TinyModelConfig(**bench.TINY, seed=0), root / "a")
    model_b = build_tiny_model(TinyModelConfig(**bench.TINY, seed=1), root / "b")
    out = bench.protocol(model_a, model_b, versions=1, extra=dict(max_model_len=64, kv_cache_memory_bytes=64 << 20))
    diff = out["mean_abs_logprob_diff_vs_new_weights"]
    noise = max(diff["noise_on_old_weights"], 1e-5)  # engine against transformers on the same weights
    assert diff["before"] > 20 * noise, diff  # the two random models differ on the text
    assert diff["after"] < 3 * noise, diff  # served: the file's weights
    cache = out["prefix_cache_after_finish"]  # the protocol keeps KV of the old weights: the caller resets
    assert cache["cached_text_diff"] > 20 * noise and cache["after_reset_diff"] < 3 * noise, cache
    assert out["weight_version_served"] == "3"  # versions 1 (the cache check), 2, then the last load
