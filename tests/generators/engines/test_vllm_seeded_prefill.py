"""Seeded requests whose prefill would be split over engine steps, on a real vLLM AsyncLLM (CPU build).

vLLM 0.32 rewinds a seeded request's generator after each partial prefill, which a CPU generator
cannot do: the engine died ("CPU Generator does not use offset") when long seeded prompts arrived
together or when an in-flight weight swap made every running request recompute a long context.
``EngineConfig.enable_chunked_prefill`` (None: off on the CPU backend) keeps every prefill whole.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import random  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig, engine_args  # noqa: E402
from asyncrl.generators.engines.vllm_stream import build_stream  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from tests.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine (~30 s)

CONTEXT = 1024
PROMPT_CHARS = 600
"""Six such prompts (or twelve sequences recomputing them) are well past vLLM's default token
budget a step (2,048 tokens for the async engine on CPU): chunked prefill would split them."""


def long_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789+") for _ in range(PROMPT_CHARS)) + "=" for _ in range(count)]


def exactly(tokens: int, n: int = 2) -> dict:
    return {"sampling": SamplingConfig(n=n, max_tokens=tokens), "min_tokens": tokens, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(seed=3, max_position_embeddings=CONTEXT), tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def stream(model):
    s = build_stream(str(model), EngineConfig(max_model_len=CONTEXT, block_size=32, kv_cache_memory_bytes=64 << 20))
    yield s
    s.close()


def collect(stream, count: int, timeout: float = 120.0) -> dict:
    out, deadline = {}, time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        for key, completions, _greedy in stream.finished(timeout=1.0):  # a dead engine raises here
            out[key] = completions
    assert len(out) == count, f"{count - len(out)} groups still running after {timeout:g} s"
    return out


def test_chunked_prefill_is_refused_on_the_cpu_backend(model):
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        engine_args(str(model), EngineConfig(max_model_len=CONTEXT, enable_chunked_prefill=True))
    assert engine_args(str(model), EngineConfig(max_model_len=CONTEXT))["enable_chunked_prefill"] is False


def test_long_seeded_prompts_arriving_together_are_sampled_and_seeds_keep_their_meaning(stream):
    prompts = long_prompts(6, seed=0)
    for i, prompt in enumerate(prompts):
        stream.submit(f"long-{i}", prompt, seed=100 + i, **exactly(8))
    stream.submit("again-0", prompts[0], seed=100, **exactly(8))  # the same prompt and seed as long-0
    done = collect(stream, 7)
    assert all([len(c.response_ids) for c in cs] == [8, 8] for cs in done.values())
    for first, again in zip(done["long-0"], done["again-0"]):
        assert first.response_ids.tolist() == again.response_ids.tolist()
    scheduler = stream.engine.llm.vllm_config.scheduler_config
    assert not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens >= CONTEXT


def test_an_in_flight_swap_that_makes_long_contexts_recompute_keeps_the_engine_alive(stream, model):
    engine = stream.engine
    before, version = stream.load.generated_tokens, engine.version + 1
    for i, prompt in enumerate(long_prompts(6, seed=1)):
        stream.submit(f"swap-{i}", prompt, seed=200 + i, **exactly(400))
    wait_until(lambda: stream.load.generated_tokens >= before + 12 * 8, "the groups' first tokens", timeout=120)
    engine.load_weights(str(model), version)  # every running request recomputes ~610 tokens
    done = collect(stream, 6)
    for completions in done.values():
        assert [len(c.response_ids) for c in completions] == [400, 400]
        for c in completions:
            assert [v for _, v in c.version_segments] == [version - 1, version]  # sampled across the swap
