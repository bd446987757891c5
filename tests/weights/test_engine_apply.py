"""Weight updates applied to a real vLLM engine (CPU build) from each transport, checked by the probe."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.weights_apply import apply_newest_weights  # noqa: E402
from asyncrl.weights.buckets import iter_buckets  # noqa: E402
from asyncrl.weights.probe import ProbeCheck, learner_probe  # noqa: E402
from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber  # noqa: E402
from asyncrl.weights.stream import ZmqWeightPublisher, ZmqWeightSubscriber  # noqa: E402
from asyncrl.weights.update import WeightSyncError  # noqa: E402
from tests.factories import RecordingContext, two_tiny_models  # noqa: E402
from tests.waits import stream_subscribed, wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine

TRANSPORTS = {"shm": (ShmWeightPublisher, ShmWeightSubscriber), "zmq": (ZmqWeightPublisher, ZmqWeightSubscriber)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return two_tiny_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def learner(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(models["b"], dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(models["b"])


@pytest.fixture(scope="module")
def engine(models):
    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    e = VLLMEngine(str(models["a"]), EngineConfig())
    yield e
    e.close()


def _apply(engine, sub, pub, ctx):
    """Apply the next version as the generator loop does; ``pub`` repeats its announcement meanwhile."""
    version = engine.version

    def applied():
        apply_newest_weights(engine, sub, ctx, probe=ProbeCheck(atol=1e-3))
        return engine.version != version

    wait_until(applied, f"{sub.name} to apply a version above {version}", interval=0.05, tick=pub.announce)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_apply_between_requests_serves_the_published_weights(engine, learner, transport):
    model, tok = learner
    Pub, Sub = TRANSPORTS[transport]
    pub, sub, ctx = Pub("tcp://127.0.0.1:0"), None, RecordingContext()
    sub = Sub(pub.address, name="gen-0.weights")
    if transport == "zmq":  # shared memory repeats its announcement instead (in _apply)
        stream_subscribed(pub.sock, [sub])
    probe = learner_probe(model, tok, max_len=engine.cfg.max_model_len)
    before = engine.score(probe["prompt"], probe["continuation_ids"])
    version = engine.version + 1
    pub.publish(iter_buckets(model, 64 << 10), version, meta={"probe": probe})
    _apply(engine, sub, pub, ctx)
    assert engine.version == version
    (ev,) = ctx.events
    assert ev.type == "version" and ev.version == version and ev.probe_diff <= 1e-3 and ev.bytes > 0
    assert abs(before - probe["logprobs"]).max() > 1e-3 or transport != "shm"  # it really changed (first test)
    pub.close()
    sub.close()


def test_probe_catches_a_deliberately_corrupted_bucket(engine, learner):
    model, tok = learner
    pub = ShmWeightPublisher("tcp://127.0.0.1:0")
    sub = ShmWeightSubscriber(pub.address, name="gen-0.weights")
    probe = learner_probe(model, tok, max_len=engine.cfg.max_model_len)

    def corrupted():  # a learner-side bug: right checksum, wrong numbers
        for i, bucket in enumerate(iter_buckets(model, 64 << 10)):
            yield [(n, t * 1.5) if i == 1 else (n, t) for n, t in bucket]

    version = engine.version + 1
    pub.publish(corrupted(), version, meta={"probe": probe})
    with pytest.raises(WeightSyncError, match=f"probe after applying version {version}: .* > 0.001"):
        _apply(engine, sub, pub, RecordingContext())
    wait_until(lambda: pub.errors, "the subscriber's error report", tick=pub.announce)
    assert pub.errors and pub.errors[0].subscriber == "gen-0.weights" and "probe" in pub.errors[0].error
    pub.close()
    sub.close()


def test_an_update_missing_weights_is_refused(engine, learner):
    model, _ = learner
    named = [(n, t) for n, t in model.named_parameters() if "layers.0." not in n]
    with pytest.raises(ValueError, match="lacks"):
        engine.load_weights(named, engine.version + 1)
