"""Swap in flight on a real vLLM AsyncLLM (CPU build): a generation that spans an update records two
version segments, and the tokens after the swap come from the new weights."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import threading  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.engines.async_vllm_engine import AsyncVLLMEngine  # noqa: E402
from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig  # noqa: E402
from asyncrl.generators.groups import build_groups  # noqa: E402
from asyncrl.generators.inflight import InFlightApplier  # noqa: E402
from asyncrl.weights.buckets import iter_buckets  # noqa: E402
from asyncrl.weights.probe import ProbeCheck, learner_probe  # noqa: E402
from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber  # noqa: E402
from asyncrl.wire import decode, encode_group  # noqa: E402
from tests.factories import RecordingContext, two_tiny_models  # noqa: E402
from tests.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines (~30 s)

PROMPT = "12+34="
LONG = SamplingConfig(n=8, temperature=1.0, max_tokens=48)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return two_tiny_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for name, path in models.items()}


@pytest.fixture(scope="module")
def engine(models):
    e = AsyncVLLMEngine(str(models["a"]), EngineConfig(max_model_len=64), timeout_s=120)
    yield e
    e.close()


def test_the_engine_core_is_forked_where_vllms_cpu_backend_asks_for_spawn(engine):
    """``engine.core_start_method`` (fork by default) is how the core process started, though vLLM's
    CPU backend sets spawn while it builds its config: a spawned core would import vLLM again."""
    cores = engine._llm.engine_core.resources.engine_manager.processes  # vLLM's multiprocessing handles
    assert [type(p._popen).__module__ for p in cores] == ["multiprocessing.popen_fork"]
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def _tokens_so_far(engine) -> int:
    """Most output tokens any running request has (vLLM's output processor: a test-only peek)."""
    states = list(engine._llm.output_processor.request_states.values())
    return max((s.detokenizer.num_output_tokens() for s in states if s.detokenizer is not None), default=0)


def _sample_while(engine, swap, min_tokens: int = 4) -> list:
    """Sample LONG from PROMPT in a thread; call ``swap()`` once some request has ``min_tokens`` tokens."""
    out = {}

    def run():
        out["completions"] = engine.generate([PROMPT], LONG, seed=3)[0]

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(
        lambda: _tokens_so_far(engine) >= min_tokens or not thread.is_alive(),
        f"a request to have {min_tokens} tokens",
        timeout=60,
        interval=0.001,
    )
    assert thread.is_alive(), "the generation ended before the swap: make it longer"
    swap()
    thread.join(120)
    return out["completions"]


def _model_logprobs(model, prompt_ids, response_ids) -> np.ndarray:
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(response_ids, dtype=torch.long)[:, None])[:, 0].numpy()


def test_a_generation_spanning_an_update_records_two_segments_and_samples_the_new_weights(engine, hf):
    assert engine.version == 0
    new = list(hf["b"].state_dict().items())
    completions = _sample_while(engine, lambda: engine.load_weights(new, 1))
    assert engine.version == 1
    spanning = [c for c in completions if c.version_segments is not None and len(c.version_segments) == 2]
    assert spanning, [c.version_segments for c in completions]
    for c in spanning:
        (start, v0), (swap_at, v1) = c.version_segments
        assert (start, v0, v1) == (0, 0, 1) and 0 < swap_at < len(c.response_ids)
        old_lp = _model_logprobs(hf["a"], c.prompt_ids, c.response_ids)
        new_lp = _model_logprobs(hf["b"], c.prompt_ids, c.response_ids)
        # Before the swap the behaviour logprobs are the old model's, after it the new one's
        # (its KV recomputed by the new weights), and the two models really differ there.
        np.testing.assert_allclose(c.logprobs[:swap_at], old_lp[:swap_at], atol=1e-3)
        np.testing.assert_allclose(c.logprobs[swap_at:], new_lp[swap_at:], atol=1e-3)
        assert np.abs(old_lp[swap_at:] - new_lp[swap_at:]).max() > 0.05
    # The group is stamped with its oldest version; the segments survive the wire.
    (group,) = build_groups(
        [{"group_id": "g", "prompt_uid": "p", "task": "addition", "text": PROMPT, "answer": "46"}],
        [completions],
        version=0,
        generator="gen-0",
        rollout_s=0.0,
    )
    assert group.policy_version == 0
    _, body = decode(encode_group(group))
    got = {s.uid: s.version_segments for s in body.group.samples}
    assert got == {s.uid: s.version_segments for s in group.samples}
    assert any(seg is not None and len(seg) == 2 for seg in got.values())


def test_shm_update_applied_in_flight_by_the_applier_passes_the_probe(engine, hf, models):
    from transformers import AutoTokenizer

    model = hf["a"]  # back to the first weights: the probe tells them apart from the engine's
    probe = learner_probe(model, AutoTokenizer.from_pretrained(models["a"]), max_len=64)
    pub = ShmWeightPublisher("tcp://127.0.0.1:0")
    sub = ShmWeightSubscriber(pub.address, name="gen-0.weights")
    version = engine.version + 1
    applier = InFlightApplier(engine, sub, probe=ProbeCheck(atol=1e-3), poll_s=0.01, name="gen-0")
    ctx = RecordingContext()
    try:
        completions = _sample_while(
            engine, lambda: pub.publish(iter_buckets(model, 64 << 10), version, meta={"probe": probe})
        )
        # The announcement is repeated meanwhile, as the learner's idle loop does: the subscriber
        # may have joined after it was first sent.
        wait_until(lambda: engine.version == version, f"the applier to swap in version {version}", tick=pub.announce)
        applier.drain(ctx)
    finally:
        applier.close()
    (ev,) = ctx.events
    assert ev.type == "version" and ev.version == version and ev.probe_diff <= 1e-3
    segments = [c.version_segments for c in completions]
    assert all(seg[0] == [0, version - 1] for seg in segments), segments
    assert all(seg[-1][1] in (version - 1, version) for seg in segments), segments
    wait_until(
        lambda: pub.acked.get("gen-0.weights", -1) >= version, f"the ack of version {version}", tick=pub.announce
    )
    pub.close()
    sub.close()


def test_a_failed_swap_in_flight_is_raised_by_drain(engine):
    class Broken:
        def newest(self, served_version, timeout=0.0):
            raise TimeoutError("gen-0.weights: waited 1.0 s for bucket 0 of version 9")

    applier = InFlightApplier(engine, Broken(), probe=None, poll_s=0.01, name="gen-0")
    wait_until(lambda: applier.error is not None, "the applier to keep the subscriber's error")
    with pytest.raises(TimeoutError, match="bucket 0 of version 9"):
        applier.drain(RecordingContext())
    applier.close()


def test_an_aborted_and_resumed_answer_holds_each_versions_own_tokens_and_logprobs(engine, hf):
    """Abort an answer under weights a, swap in b, resume it: the prefix keeps a's tokens and
    logprobs (rescored by the engine under a), the rest is b's (rescored under b), and the
    segments record the switch."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    old = engine.version + 1
    engine.load_weights(list(hf["a"].state_dict().items()), old)
    params = SamplingParams(
        n=1,
        temperature=1.0,
        max_tokens=40,
        logprobs=0,
        ignore_eos=True,
        seed=7,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    running = engine.submit(engine.sample_request(engine.tokenizer.encode(PROMPT), params, "answer-0"))
    wait_until(lambda: _tokens_so_far(engine) >= 4 or running.done(), "the answer to have 4 tokens", interval=0.001)
    assert engine.requests_older_than(old + 1) == ["answer-0"] and engine.requests_older_than(old) == []
    engine.abort_requests(["answer-0"])
    partial = running.result(60)
    cut = len(partial.response_ids)
    assert partial.finish_reason == "abort" and 0 < cut < 40 and partial.version_segments == [[0, old]]
    assert engine.requests_older_than(old + 1) == []  # an aborted request is no longer running

    new = old + 1
    engine.load_weights(list(hf["b"].state_dict().items()), new)
    whole = engine.submit(engine.resume_request(partial, params, "answer-0/resumed")).result(60)
    assert whole.finish_reason == "length" and len(whole.response_ids) == 40 and whole.resumed == 1
    assert whole.version_segments == [[0, old], [cut, new]]
    np.testing.assert_array_equal(whole.response_ids[:cut], partial.response_ids)
    np.testing.assert_array_equal(whole.logprobs[:cut], partial.logprobs)
    np.testing.assert_array_equal(whole.prompt_ids, partial.prompt_ids)
    assert whole.text == engine.tokenizer.decode(whole.response_ids.tolist(), skip_special_tokens=True)

    under_new = engine.score(PROMPT, whole.response_ids.tolist())
    engine.load_weights(list(hf["a"].state_dict().items()), new + 1)
    under_old = engine.score(PROMPT, whole.response_ids.tolist())
    np.testing.assert_allclose(whole.logprobs[:cut], under_old[:cut], atol=1e-3)
    np.testing.assert_allclose(whole.logprobs[cut:], under_new[cut:], atol=1e-3)
    assert np.abs(under_old[cut:] - under_new[cut:]).max() > 0.05  # the two versions really differ there
