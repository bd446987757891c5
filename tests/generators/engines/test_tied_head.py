"""A head tied to the embedding serves the new weights after an in-place reload (SmolLM2-135M,
float32, vLLM's CPU build): before the head was re-packed, logits still came from the initial
embedding matrix (``asyncrl.generators.engines.tied_head``)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.weights.buckets import iter_buckets  # noqa: E402
from asyncrl.weights.probe import learner_probe  # noqa: E402

pytestmark = pytest.mark.slow  # a real model and a vLLM engine


def test_a_tied_head_follows_the_reloaded_embedding(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    engine = VLLMEngine(str(smollm2_dir), EngineConfig(max_model_len=256, kv_cache_memory_bytes=64 << 20))

    def mismatch() -> float:
        probe = learner_probe(model, tok, max_len=256)
        served = engine.score(probe["prompt"], probe["continuation_ids"])
        return float(np.mean(np.abs(np.asarray(served, np.float64) - np.asarray(probe["logprobs"]))))

    try:
        at_start = mismatch()
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(1.02)  # the one tensor the head shares
        engine.load_weights([(n, t) for bucket in iter_buckets(model, 64 << 20) for n, t in bucket], 1)
        after = mismatch()
    finally:
        engine.close()
    assert at_start < 1e-4 and after < 1e-4, (at_start, after)  # a stale head gave 0.023
