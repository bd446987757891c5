"""Adapters on vLLM's AsyncLLM (CPU build): a request running when a new adapter loads keeps its
own adapter to its end (all its tokens carry that version), and the old adapter is retired only
then; requests after the load run on the new one."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402

from asyncrl.generators.engines.async_vllm_engine import AsyncVLLMEngine  # noqa: E402
from asyncrl.generators.engines.vllm_engine import EngineConfig  # noqa: E402
from tests.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine

TARGETS = ["q_proj", "v_proj"]
ADAPTER = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS, "base_version": 0}


def adapter_version(model, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return list(get_peft_model_state_dict(model).items())


def test_a_running_request_keeps_its_adapter_and_the_old_one_goes_when_it_ends(tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    model_dir = build_tiny_model(TinyModelConfig(seed=1), tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    engine = AsyncVLLMEngine(
        str(model_dir), EngineConfig(max_model_len=64, lora_serving="adapter"), timeout_s=120, lora_rank=8
    )
    params = SamplingParams(
        n=1, max_tokens=20, logprobs=0, ignore_eos=True, seed=7, output_kind=RequestOutputKind.FINAL_ONLY
    )
    prompt = engine.tokenizer.encode("12+34=")
    try:
        engine.load_weights(adapter_version(model, 1), 1, adapter=ADAPTER)
        first = engine.adapters.newest
        # Hold the scheduler so that the request is surely running (holding its adapter) when v2 loads.
        engine._call(engine.llm.pause_generation(mode="keep", clear_cache=False), "a pause")
        running = engine.submit(engine.sample_request(prompt, params, "answer-0"))
        wait_until(lambda: first.users == 1, "the request to take adapter v1")
        engine.load_weights(adapter_version(model, 2), 2, adapter=ADAPTER)
        second = engine.adapters.newest
        assert second.version == 2 and second.lora_id != first.lora_id
        assert engine.adapters.live == [first, second] and first.folder.exists()  # still in use
        engine._call(engine.llm.resume_generation(), "the resume")
        done = running.result(60)
        assert done.version_segments == [[0, 1]] and len(done.response_ids) == 20
        wait_until(lambda: engine.adapters.live == [second], "adapter v1 to be retired")
        assert set(engine._call(engine.llm.list_loras(), "the adapters")) == {second.lora_id}
        after = engine.submit(engine.sample_request(prompt, params, "answer-1")).result(60)
        assert after.version_segments == [[0, 2]]
        assert list(after.response_ids) != list(done.response_ids)  # same seed, another adapter
    finally:
        engine.close()
