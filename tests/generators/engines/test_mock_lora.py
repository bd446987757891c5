"""The simulated engine takes adapter-only updates as vLLM does: checked, and a running request
keeps the version (the adapter) it started with."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl.generators.config import MockEngineConfig
from asyncrl.generators.engines.mock_engine import MockEngine
from asyncrl.generators.engines.mock_stream import MockStream
from asyncrl.generators.sampling import SamplingConfig
from asyncrl.weights.update import WeightSyncError

META = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "base_version": 0}
PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"
ADAPTER = [(f"{PREFIX}.lora_A.weight", torch.zeros(2, 8)), (f"{PREFIX}.lora_B.weight", torch.zeros(8, 2))]


def test_an_adapter_update_is_checked_and_served():
    engine = MockEngine(MockEngineConfig(load_weights_s=0))
    engine.load_weights(ADAPTER, 1, adapter=META)
    assert engine.version == 1 and engine.serves_adapter
    with pytest.raises(WeightSyncError, match="both factors"):
        engine.load_weights(ADAPTER[:1], 2, adapter=META)
    with pytest.raises(WeightSyncError, match="lora_alpha"):
        engine.load_weights(ADAPTER, 2, adapter={"r": 2, "target_modules": ["q_proj"]})
    assert engine.version == 1
    engine.load_weights(None, 3)  # full weights again
    assert not engine.serves_adapter


def test_a_request_running_when_an_adapter_loads_keeps_its_version_and_new_ones_take_the_new():
    engine = MockEngine(MockEngineConfig(length_sigma=0, length_median=100, decode_step_s=0.004, overhead_s=0))
    stream = MockStream(engine)
    stream.submit("g0", "1+2=", SamplingConfig(n=2, max_tokens=128))
    time.sleep(0.1)
    engine.load_weights(ADAPTER, 1, adapter=META)  # as the in-flight applier does, from its thread
    stream.submit("g1", "3+4=", SamplingConfig(n=1, max_tokens=128))
    done = {}
    deadline = time.monotonic() + 10
    while len(done) < 2 and time.monotonic() < deadline:
        done.update({key: comps for key, comps, _ in stream.finished(timeout=1)})
    assert [c.version_segments for c in done["g0"]] == [[[0, 0]], [[0, 0]]]
    assert [c.version_segments for c in done["g1"]] == [[[0, 1]]]
