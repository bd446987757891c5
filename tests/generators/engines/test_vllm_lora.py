"""Adapter-only versions served by a real vLLM engine (CPU build) as LoRA adapters: published over
shared memory with their meta, checked by the probe against the learner's peft model, each under a
fresh name, the old ones retired; an engine that serves the base model instead fails the probe."""

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
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402

from asyncrl.generators.weights_apply import apply_newest_weights  # noqa: E402
from asyncrl.weights.buckets import state_dict_buckets  # noqa: E402
from asyncrl.weights.probe import Probe, ProbeCheck, learner_probe  # noqa: E402
from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber  # noqa: E402
from asyncrl.weights.update import WeightSyncError  # noqa: E402
from tests.factories import RecordingContext  # noqa: E402
from tests.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS, "base_version": 0}


def step(model, seed: int) -> None:
    """Move the adapter as training would (peft starts lora_B at zero: the adapter is then the base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def test_adapter_versions_are_served_checked_and_retired(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    model_dir = build_tiny_model(TinyModelConfig(seed=1), tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    engine = VLLMEngine(str(model_dir), EngineConfig(max_model_len=64, block_size=32, seed=0), lora_rank=8)
    pub = ShmWeightPublisher("tcp://127.0.0.1:0")
    sub = ShmWeightSubscriber(pub.address, name="gen-0.weights")
    check, ctx = ProbeCheck(atol=1e-3), RecordingContext()
    last = Probe(**learner_probe(model, tok, max_len=64), version=0)  # the initial weights: adapter = base

    def publish_and_apply(version: int, seed: int):
        nonlocal last
        step(model, seed)
        body = learner_probe(model, tok, max_len=64)
        last = last.after(version, body["logprobs"], body["base_logprobs"])
        state = get_peft_model_state_dict(model)
        pub.publish(state_dict_buckets(state, 64 << 10), version, meta={"probe": last.to_wire(), "adapter": ADAPTER})

        def applied():
            apply_newest_weights(engine, sub, ctx, probe=check)
            return engine.version == version

        wait_until(applied, f"version {version} to be served", interval=0.05, tick=pub.announce)
        return body, sum(t.numel() * t.element_size() for t in state.values())

    try:
        body, nbytes = publish_and_apply(1, seed=1)
        ev = ctx.events[-1]
        assert ev.version == 1 and ev.bytes == nbytes and ev.probe.noise < 1e-5  # calibrated on the shared base
        assert ev.probe.mean_diff <= ev.probe.tol and ev.probe.base_separation > 100 * ev.probe.tol
        served = engine.score(body["prompt"], body["continuation_ids"])
        assert np.abs(served - np.array(body["logprobs"])).mean() <= check.tol  # the learner's peft model
        first = engine.adapters.newest

        publish_and_apply(2, seed=2)
        second = engine.adapters.newest
        assert (second.name, second.lora_id) != (first.name, first.lora_id) and second.version == 2
        assert engine.adapters.live == [second] and not first.folder.exists()  # retired: no request holds it
        assert engine._llm.llm_engine.list_loras() == {second.lora_id}
        assert len(engine.generate(["12+34="], _sampling())[0]) == 2  # sampling runs on the adapter

        engine.lora_request = lambda: None  # the bug peers shipped: requests that never name the adapter
        with pytest.raises(WeightSyncError, match="serves the base model, not the adapter"):
            publish_and_apply(3, seed=3)
        assert engine.adapters.used_names == [first.name, second.name, engine.adapters.newest.name]
    finally:
        pub.close()
        sub.close()
        engine.close()


def _sampling():
    from asyncrl.generators.sampling import SamplingConfig

    return SamplingConfig(n=2, max_tokens=4)
