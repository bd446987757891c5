"""The collective transport: the NCCL code path run over gloo on CPU (threads as ranks), and on
GPUs with NCCL itself (marked ``gpu``: it fails, never skips, where CUDA is missing)."""

import multiprocessing as mp
import queue as queues
import threading
import time

import pytest
import torch
import zmq

from asyncrl.weights.buckets import state_dict_buckets
from asyncrl.weights.config import WeightSyncConfig
from asyncrl.weights.nccl import NcclWeightPublisher, NcclWeightSubscriber
from asyncrl.weights.update import WeightSyncError
from asyncrl.wire.messages import WeightsAnnouncement
from tests.waits import has_message, wait_subscribed


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(1000, 64, generator=g),
        "model.norm.weight": torch.randn(63, generator=g).to(torch.bfloat16),  # odd size: padded to 8 bytes
        "lm_head.bias": torch.randn(3, generator=g).half(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=g),
    }


def _probe(pub):
    """An announcement subscribers ignore: a repeat of version 0, which they serve from the start."""
    pub.announcer.send_once({"policy_version": 0})


def _subscribed(pub, subs):
    """Probe until every subscriber has heard the learner (``wait_subscribed``): the first
    announcement must reach them, since forming the group blocks the learner until they join."""
    wait_subscribed(
        lambda: _probe(pub), lambda: all(has_message(s.sub.sock) for s in subs), "the subscribers to be subscribed"
    )


def _take(sub, served, out, key, timeout=30.0):
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            update = sub.newest(served, timeout=0.1)
            if update is not None:
                out[key] = (update.version, {n: t.clone() for n, t in update.tensors}, update.meta)
                update.done()
                return
        out[key] = AssertionError(f"{sub.name}: waited {timeout:.0f} s for a version above {served}")
    except BaseException as e:  # handed to the test thread
        out[key] = e


def _publish_to(pub, subs, sd, version, served):
    out = {}
    threads = [threading.Thread(target=_take, args=(s, served, out, i)) for i, s in enumerate(subs)]
    for t in threads:
        t.start()
    stats = pub.publish(state_dict_buckets(sd, 64 << 10), version, meta={"probe": {"prompt": "x"}})
    for t in threads:
        t.join(60)
    return stats, out


def test_collective_round_trip_over_gloo_is_bit_identical_for_every_version():
    pub = NcclWeightPublisher("tcp://127.0.0.1:0", num_subscribers=2, backend="gloo", timeout_s=30)
    subs = [NcclWeightSubscriber(pub.address, rank=r, name=f"g{r}", backend="gloo", timeout_s=30) for r in (1, 2)]
    _subscribed(pub, subs)
    for version in (1, 2):  # the second reuses the group formed by the first
        sd = _state(version)
        stats, out = _publish_to(pub, subs, sd, version, served=version - 1)
        assert stats["buckets"] >= 3
        for i in range(2):
            assert not isinstance(out[i], BaseException), out[i]
            got_version, got, meta = out[i]
            assert got_version == version and meta == {"probe": {"prompt": "x"}} and list(got) == list(sd)
            for name, t in sd.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert all(s.newest(2) is None for s in subs)  # the repeated announcement is not taken twice
    pub.close()
    for s in subs:
        s.close()


def test_a_subscriber_waiting_for_a_silent_learner_names_what_it_waited_for():
    pub = NcclWeightPublisher("tcp://127.0.0.1:0", num_subscribers=1, backend="gloo", timeout_s=30)
    sub = NcclWeightSubscriber(pub.address, rank=1, name="gen-0.weights", backend="gloo", timeout_s=1.0)
    announcement = WeightsAnnouncement(policy_version=4, transport="nccl", store=pub.store_address, world_size=2)
    with pytest.raises(
        WeightSyncError, match=r"gen-0.weights: waited 1.0 s to join the learner's gloo group at .* as rank 1 of 2"
    ):
        sub.receive(announcement)  # the learner never forms the group
    pub.close()
    sub.close()


def test_a_learner_whose_generators_never_join_names_what_it_waited_for():
    pub = NcclWeightPublisher("tcp://127.0.0.1:0", num_subscribers=2, backend="gloo", timeout_s=1.0)
    with pytest.raises(
        WeightSyncError, match=r"learner.weights.nccl: waited 1.0 s to form the gloo group with 2 generators"
    ):
        pub.publish(state_dict_buckets(_state(), 64 << 10), 1)
    pub.close()


def test_nccl_without_cuda_is_a_config_error_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"weights.transport \(nccl\) needs CUDA"):
        WeightSyncConfig(transport="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"weights.checksum \(crc32\) must be sum64"):
        WeightSyncConfig(transport="nccl", checksum="crc32")
    assert WeightSyncConfig(transport="nccl").transport == "nccl"


def _gpu_subscriber(address, rank, queue):
    torch.cuda.set_device(rank)
    sub = NcclWeightSubscriber(address, rank=rank, name=f"gen-{rank}", timeout_s=60)
    # Subscribed once the learner's probe arrives (it stays queued: newest() ignores it).
    heard = sub.sub.sock.poll(120_000, zmq.POLLIN)
    queue.put("subscribed" if heard else f"gen-{rank}: waited 120 s for the learner's probe")
    out = {}
    _take(sub, 0, out, "u", timeout=120)
    result = out.get("u")
    if isinstance(result, BaseException) or result is None:
        queue.put(repr(result))
    else:
        version, got, _ = result
        queue.put((version, {n: t.cpu() for n, t in got.items()}, {n: str(t.device) for n, t in got.items()}))
    sub.close()


@pytest.mark.gpu
def test_nccl_round_trip_between_gpus_is_bit_identical():
    assert torch.cuda.is_available(), "this test needs CUDA (selected by -m gpu)"
    assert torch.cuda.device_count() >= 2, "NCCL needs one GPU per rank: this test needs 2 or more"
    ranks = min(torch.cuda.device_count() - 1, 3)
    torch.cuda.set_device(0)
    sd = {k: v.cuda(0) for k, v in _state(5).items()}
    pub = NcclWeightPublisher("tcp://127.0.0.1:0", num_subscribers=ranks, timeout_s=120)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gpu_subscriber, args=(pub.address, r, queue)) for r in range(1, ranks + 1)]
    for p in procs:
        p.start()
    heard = []

    def every_one_heard():
        try:
            while len(heard) < ranks:
                heard.append(queue.get(timeout=0.05))
        except queues.Empty:
            return False
        return True

    # Spawned processes importing torch and CUDA: a generous bound.
    wait_subscribed(lambda: _probe(pub), every_one_heard, f"{ranks} GPU subscribers to be subscribed", timeout=240)
    assert heard == ["subscribed"] * ranks
    stats = pub.publish(state_dict_buckets(sd, 64 << 10), 1)
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert stats["buckets"] >= 3
    for result in results:
        assert not isinstance(result, str), result
        version, got, devices = result
        assert version == 1 and list(got) == list(sd)
        assert all(d.startswith("cuda") for d in devices.values())
        for name, t in sd.items():
            assert torch.equal(got[name], t.cpu()), name
    pub.close()
