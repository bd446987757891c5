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


class LearnerSide:
    """A peft learner that publishes its adapter over shared memory, and a generator's engine that applies each version."""

    def __init__(self, model_dir, engine):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
        self.engine = engine
        self.pub = ShmWeightPublisher("tcp://127.0.0.1:0")
        self.sub = ShmWeightSubscriber(self.pub.address, name="gen-0.weights")
        self.check, self.ctx = ProbeCheck(atol=1e-3), RecordingContext()
        self.last = Probe(**learner_probe(self.model, self.tok, max_len=64), version=0)  # adapter = base

    def publish_and_apply(self, version: int, seed: int):
        step(self.model, seed)
        body = learner_probe(self.model, self.tok, max_len=64)
        self.last = self.last.after(version, body["logprobs"], body["base_logprobs"])
        state = get_peft_model_state_dict(self.model)
        meta = {"probe": self.last.to_wire(), "adapter": ADAPTER}
        self.pub.publish(state_dict_buckets(state, 64 << 10), version, meta=meta)

        def applied():
            apply_newest_weights(self.engine, self.sub, self.ctx, probe=self.check)
            return self.engine.version == version

        wait_until(applied, f"version {version} to be served", interval=0.05, tick=self.pub.announce)
        return body, sum(t.numel() * t.element_size() for t in state.values())

    def close(self):
        self.pub.close()
        self.sub.close()
        self.engine.close()


def _engine(tmp_path, serving: str):
    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    model_dir = build_tiny_model(TinyModelConfig(seed=1), tmp_path / "base")
    cfg = EngineConfig(max_model_len=64, block_size=32, seed=0, lora_serving=serving)
    return model_dir, VLLMEngine(str(model_dir), cfg, lora_rank=8)


def test_adapter_versions_are_served_checked_and_retired(tmp_path):
    side = LearnerSide(*_engine(tmp_path, "adapter"))
    engine, ctx, check = side.engine, side.ctx, side.check
    try:
        body, nbytes = side.publish_and_apply(1, seed=1)
        ev = ctx.events[-1]
        assert ev.version == 1 and ev.bytes == nbytes and ev.probe.noise < 1e-5  # calibrated on the shared base
        assert ev.probe.mean_diff <= ev.probe.tol and ev.probe.base_separation > 100 * ev.probe.tol
        served = engine.score(body["prompt"], body["continuation_ids"])
        assert np.abs(served - np.array(body["logprobs"])).mean() <= check.tol  # the learner's peft model
        first = engine.adapters.newest

        side.publish_and_apply(2, seed=2)
        second = engine.adapters.newest
        assert (second.name, second.lora_id) != (first.name, first.lora_id) and second.version == 2
        assert engine.adapters.live == [second] and not first.folder.exists()  # retired: no request holds it
        assert engine._llm.llm_engine.list_loras() == {second.lora_id}
        assert len(engine.generate(["12+34="], _sampling())[0]) == 2  # sampling runs on the adapter

        engine.lora_request = lambda: None  # the bug peers shipped: requests that never name the adapter
        with pytest.raises(WeightSyncError, match="serves the base model, not the adapter"):
            side.publish_and_apply(3, seed=3)
        assert engine.adapters.used_names == [first.name, second.name, engine.adapters.newest.name]
    finally:
        side.close()


def test_merged_on_the_generator_the_adapter_passes_the_probe(tmp_path):
    """``engine.lora_serving: merge``: base + B·A·alpha/r reloaded into the targeted matrices only."""
    side = LearnerSide(*_engine(tmp_path, "merge"))
    try:
        assert side.engine.merging and side.engine.adapters is None
        for version in (1, 2):
            side.publish_and_apply(version, seed=version)
            ev = side.ctx.events[-1]
            assert ev.probe.mean_diff <= ev.probe.tol and ev.probe.base_separation > 100 * ev.probe.tol
    finally:
        side.close()


def _sampling():
    from asyncrl.generators.sampling import SamplingConfig

    return SamplingConfig(n=2, max_tokens=4)
