"""Partial rollouts on a real vLLM AsyncLLM (CPU build): a group whose answers run apart is caught
by a weight update, its answers aborted and resumed under the new weights; each answer's tokens
and behaviour logprobs are those of the version that sampled them, and so are the versions the
learner weighs them by."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig  # noqa: E402
from asyncrl.generators.engines.vllm_stream import build_stream  # noqa: E402
from asyncrl.generators.groups import build_groups  # noqa: E402
from asyncrl.learner.batch import collate  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from tests.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine (~30 s)

PROMPT = "12+34="
LENGTH = 200


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two tiny models of one shape (seeds 1 and 2), as (name, tensor) pairs to swap in."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        path = build_tiny_model(TinyModelConfig(seed=seed, max_position_embeddings=256), root / name)
        out[name] = (path, list(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items()))
    return out


@pytest.fixture(scope="module")
def stream(weights):
    s = build_stream(
        str(weights["a"][0]), EngineConfig(max_model_len=256, block_size=32, kv_cache_memory_bytes=64 << 20)
    )
    s.answers_apart = True  # generator.partial_rollouts: resume
    yield s
    s.close()


def _fewest_tokens(stream) -> int:
    """Fewest output tokens of the running requests (vLLM's output processor: a test-only peek)."""
    states = list(stream.engine.llm.output_processor.request_states.values())
    counts = [s.detokenizer.num_output_tokens() for s in states if s.detokenizer is not None]
    return min(counts) if len(counts) == 2 else 0


def test_a_group_resumed_across_an_update_holds_each_versions_tokens_and_logprobs(stream, weights):
    engine = stream.engine
    old = engine.version + 1
    engine.load_weights(weights["a"][1], old)
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=LENGTH)
    stream.submit("g0", PROMPT, sampling, seed=7, min_tokens=LENGTH, ignore_eos=True)
    wait_until(lambda: _fewest_tokens(stream) >= 4, "both answers to have 4 tokens", timeout=60, interval=0.001)
    new = old + 1
    engine.load_weights(weights["b"][1], new)
    assert stream.resume_older_than(new) == 2  # a bound of 0: every answer holding old's tokens
    ((key, completions, _),) = stream.finished(timeout=120)
    assert key == "g0" and stream.running == 0

    cuts = []
    for c in completions:
        assert c.resumed == 1 and c.finish_reason == "length" and len(c.response_ids) == LENGTH
        (start, v0), (cut, v1) = c.version_segments  # the abort joined the in-flight switch: two segments
        assert (start, v0, v1) == (0, old, new) and 4 <= cut < LENGTH
        cuts.append(cut)
        assert c.text == engine.tokenizer.decode(c.response_ids.tolist(), skip_special_tokens=True)
    under_new = [engine.score(PROMPT, c.response_ids.tolist()) for c in completions]
    engine.load_weights(weights["a"][1], new + 1)
    under_old = [engine.score(PROMPT, c.response_ids.tolist()) for c in completions]
    # Each part matches the version that sampled it (up to the CPU kernels' batch-shape noise,
    # ~3e-3 here) and not the other one, which is far off on both parts.
    for c, cut, a, b in zip(completions, cuts, under_old, under_new):
        np.testing.assert_allclose(c.logprobs[:cut], a[:cut], atol=1e-2)
        np.testing.assert_allclose(c.logprobs[cut:], b[cut:], atol=1e-2)
        assert np.abs(c.logprobs[:cut] - b[:cut]).max() > 0.05 and np.abs(c.logprobs[cut:] - a[cut:]).max() > 0.05

    # The learner weighs each token by the version that sampled it.
    row = {"group_id": "g0", "prompt_uid": "p", "text": PROMPT, "answer": "46", "task": "addition"}
    (group,) = build_groups([row], [completions], new, "generator-0", rollout_s=1.0)
    assert group.policy_version == old
    batch = collate([group], [np.zeros(2)], pad_id=0)
    for b, (c, cut) in enumerate(zip(completions, cuts)):
        in_response = batch.response_mask[b] > 0
        assert batch.behaviour_version[b][in_response].tolist() == [old] * cut + [new] * (LENGTH - cut)
        torch.testing.assert_close(batch.behaviour_logprobs[b][in_response], torch.from_numpy(c.logprobs))
