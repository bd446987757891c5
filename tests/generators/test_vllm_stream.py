"""Continuous batching on a real vLLM AsyncLLM (CPU build): groups submitted one by one share the
running batch, a short one leaves before a long one submitted earlier, an aborted one frees the
engine, and the engine reports its KV capacity and load."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import time  # noqa: E402

import pytest  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.engine import EngineConfig, SamplingConfig  # noqa: E402
from asyncrl.generators.vllm_stream import build_stream  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from tests.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine (~30 s)

PROMPT = "12+34="


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    model = build_tiny_model(TinyModelConfig(seed=1, max_position_embeddings=256), tmp_path_factory.mktemp("model"))
    s = build_stream(str(model), EngineConfig(max_model_len=256, block_size=32, kv_cache_memory_bytes=64 << 20))
    yield s
    s.close()


def exactly(tokens: int, n: int = 2) -> dict:
    """Sampling of answers exactly ``tokens`` long (EOS ignored), as the generation benchmark draws them."""
    return {"sampling": SamplingConfig(n=n, max_tokens=tokens), "min_tokens": tokens, "ignore_eos": True}


def test_a_short_group_submitted_later_leaves_before_a_long_one(stream):
    capacity = stream.capacity()
    cache = stream.engine.llm.vllm_config.cache_config
    assert capacity == min(256, cache.num_gpu_blocks * cache.block_size // 256) > 4
    stream.submit("long", PROMPT, seed=1, **exactly(200))
    wait_until(lambda: stream.load.running == 2, "the long group to run", timeout=60, interval=0.01)
    stream.submit("short", PROMPT, seed=2, greedy_tokens=4, **exactly(3))
    assert stream.running == 2 + 2 + 1  # its greedy answer is a sequence too
    order, lengths = [], {}
    deadline = time.monotonic() + 120
    while len(order) < 2 and time.monotonic() < deadline:
        for key, completions, greedy in stream.finished(timeout=1.0):
            order.append(key)
            lengths[key] = [len(c.response_ids) for c in completions]
            assert (greedy is not None) == (key == "short")
    assert order == ["short", "long"] and lengths == {"short": [3, 3], "long": [200, 200]}
    assert stream.running == 0
    assert stream.load.generated_tokens >= 2 * 203 and stream.load.sequence_seconds() > 0


def test_an_aborted_group_leaves_the_engine(stream):
    stream.submit("doomed", PROMPT, seed=3, **exactly(240))
    wait_until(lambda: stream.load.running == 2, "the group to run", timeout=60, interval=0.01)
    stream.abort(["doomed"])
    assert stream.running == 0
    wait_until(lambda: not stream.engine.llm.output_processor.request_states, "vLLM to drop the request", timeout=30)
    stream.submit("after", PROMPT, seed=4, **exactly(2))
    ((key, completions, _),) = stream.finished(timeout=60)
    assert key == "after" and [len(c.response_ids) for c in completions] == [2, 2]
