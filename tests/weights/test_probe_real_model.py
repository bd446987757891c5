"""The probe on a real pretrained model (SmolLM2-135M-Instruct, 30 layers) in bfloat16 on both
sides, where a fixed tolerance on two tokens failed healthy updates: calibrated at the weights
both sides share, it passes updates the size of training steps and fails a corrupted bucket and
an update that did not load, naming which."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.weights.buckets import iter_buckets  # noqa: E402
from asyncrl.weights.probe import Probe, ProbeCheck, learner_probe, probe_tolerance  # noqa: E402
from asyncrl.weights.update import WeightSyncError  # noqa: E402

pytestmark = pytest.mark.slow  # a real model, a vLLM engine in emulated bfloat16 on CPUs without AVX512-BF16

MAX_LEN = 256


@pytest.fixture(scope="module")
def sides(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    engine = VLLMEngine(
        str(smollm2_dir), EngineConfig(dtype="bfloat16", max_model_len=MAX_LEN, kv_cache_memory_bytes=64 << 20)
    )
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    yield engine, model, AutoTokenizer.from_pretrained(smollm2_dir)
    engine.close()


def _step(model, size: float, seed: int) -> None:
    """An update the size of an Adam step: every weight moves by ``size`` relative, signs at random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
            p.add_(p.abs().clamp_min(1e-3) * size * sign)


def _publish(engine, model, tok, check, probe, version, *, load=True, corrupt=False):
    """What a generator does with a version: calibrate (once), load, check; returns the new probe."""
    new = probe.after(version, learner_probe(model, tok, max_len=MAX_LEN)["logprobs"])
    check.before_load(engine, new.to_wire())
    if load:
        tensors = [
            (n, t * 1.5 if corrupt and i == 3 else t)
            for i, bucket in enumerate(iter_buckets(model, 16 << 20))
            for n, t in bucket
        ]
        engine.load_weights(tensors, version)
    return new, check.check(engine, new.to_wire(), version)


def test_healthy_bf16_updates_pass_and_broken_ones_fail_by_name(sides):
    engine, model, tok = sides
    check = ProbeCheck(probe_tolerance("bfloat16", "bf16"))
    probe = Probe(**learner_probe(model, tok, max_len=MAX_LEN), version=0)
    assert len(probe.continuation_ids) >= 40  # dozens of tokens, not two

    for version in (1, 2, 3):  # a learning rate of 1e-5, three steps
        _step(model, 1e-5, seed=version)
        probe, result = _publish(engine, model, tok, check, probe, version)
        assert result.mean_diff <= result.tol and check.noise is not None
    assert result.max_diff > 0  # bfloat16 on both sides: never exact

    with pytest.raises(WeightSyncError, match="probe after applying version 4: .* neither the published"):
        _step(model, 1e-5, seed=4)
        _publish(engine, model, tok, check, probe, 4, corrupt=True)

    _step(model, 1e-2, seed=5)  # far enough from the served weights to tell
    with pytest.raises(WeightSyncError, match="the update did not load"):
        engine.load_weights([(n, t) for b in iter_buckets(model, 16 << 20) for n, t in b], 5)
        probe = probe.after(5, learner_probe(model, tok, max_len=MAX_LEN)["logprobs"])
        _step(model, 5e-2, seed=6)
        _publish(engine, model, tok, check, probe, 6, load=False)
