"""Round trips of the CPU transports (bit-identical), corruption, timeouts, dead subscribers."""

import multiprocessing as mp
import os
import threading

import pytest
import torch
import zmq

from asyncrl import wire
from asyncrl.weights.buckets import HASHES, state_dict_buckets
from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber
from asyncrl.weights.stream import ZmqWeightPublisher, ZmqWeightSubscriber, tensors_checksum
from asyncrl.weights.update import WeightSyncError
from tests.waits import STREAM_PROBE, has_message, receive_version, stream_subscribed, wait_subscribed, wait_until

TRANSPORTS = {"shm": (ShmWeightPublisher, ShmWeightSubscriber), "zmq": (ZmqWeightPublisher, ZmqWeightSubscriber)}


def _state(seed=0, big=1000):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(big, 64, generator=g),
        "model.norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
        "lm_head.bias": torch.randn(3, generator=g).half(),
        "step": torch.arange(5),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=g),
    }


@pytest.mark.parametrize("hash", HASHES)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_round_trip_is_bit_identical_to_every_subscriber(transport, hash):
    Pub, Sub = TRANSPORTS[transport]
    pub = Pub("tcp://127.0.0.1:0", hash=hash)
    subs = [Sub(pub.address, name=f"g{i}") for i in range(2)]
    if transport == "zmq":  # shared memory repeats its announcement instead (in _receive)
        stream_subscribed(pub.sock, subs)
    sd = _state()
    stats = pub.publish(state_dict_buckets(sd, 64 << 10), 7, meta={"probe": {"prompt": "x"}})
    assert stats["buckets"] >= 3 and stats["bytes"] >= sum(t.numel() * t.element_size() for t in sd.values())
    for sub in subs:
        update = receive_version(sub, pub)
        assert update.version == 7 and update.meta["probe"] == {"prompt": "x"}
        got = dict(update.tensors)
        assert list(got) == list(sd)
        for name, t in sd.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
        update.done()
        assert sub.newest(7) is None  # nothing newer
    pub.close()
    for sub in subs:
        sub.close()


def test_shm_keeps_a_version_until_every_subscriber_is_past_it():
    pub = ShmWeightPublisher("tcp://127.0.0.1:0")
    g0, g1 = (ShmWeightSubscriber(pub.address, name=n) for n in ("g0", "g1"))
    pub.publish(state_dict_buckets(_state(), 1 << 20), 1)
    receive_version(g0, pub).done()
    receive_version(g1, pub).done()
    wait_until(lambda: pub.acked == {"g0": 1, "g1": 1}, "both acks of version 1", tick=pub.announce)
    pub.publish(state_dict_buckets(_state(1), 1 << 20), 2)
    receive_version(g0, pub, served=1).done()
    held = receive_version(g1, pub, served=1)  # g1 is still loading version 2
    wait_until(lambda: pub.acked["g0"] == 2, "g0's ack of version 2", tick=pub.announce)
    pub.publish(state_dict_buckets(_state(2), 1 << 20), 3)
    pub.announce()
    assert not (pub.dir / "v000001").exists()  # everyone is past it
    assert (pub.dir / "v000002").exists()  # g1 is still reading it
    held.done()
    update = receive_version(g1, pub, served=2)
    assert update.version == 3
    update.done()
    wait_until(lambda: not (pub.dir / "v000002").exists(), "version 2 to be removed", tick=pub.announce)
    assert (pub.dir / "v000003").exists()
    pub.close()
    g0.close()
    g1.close()
    assert not pub.dir.exists()


def test_shm_checksum_catches_a_corrupted_bucket_and_reports_it():
    pub = ShmWeightPublisher("tcp://127.0.0.1:0")
    pub.publish(state_dict_buckets(_state(), 64 << 10), 3)
    path = pub.dir / "v000003" / "b00001"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    sub = ShmWeightSubscriber(pub.address, name="g0")  # joins after the corruption (it checks on arrival)
    with pytest.raises(WeightSyncError, match="version 3 bucket b00001: sum64 checksum mismatch"):
        receive_version(sub, pub)  # hears a repeat of the announcement
    pub.close()
    sub.close()


def test_zmq_checksum_catches_a_corrupted_bucket():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ZmqWeightSubscriber(f"tcp://127.0.0.1:{port}", name="g0", timeout_s=2)
    stream_subscribed(pub, [sub])
    pub.send(wire.encode_map("weights_begin", {"policy_version": 1}))
    header = {"policy_version": 1, "index": 0, "crc": 12345, "nbytes": 8, "tensors": [["w", "float32", [2], 0, 8]]}
    pub.send_multipart([wire.encode_map("weights_bucket", header), b"\0" * 8])
    with pytest.raises(WeightSyncError, match="version 1 bucket 0: crc32 checksum mismatch"):
        receive_version(sub)
    pub.close()
    sub.close()


@pytest.mark.parametrize("algo", ["fletcher64", "xxh3"])
@pytest.mark.parametrize("corrupt", ["flipped byte", "words swapped"])
def test_the_zmq_stream_catches_a_frame_corrupted_in_transit(corrupt, algo):
    data = torch.arange(64, dtype=torch.int64).view(torch.uint8).numpy().copy()  # one tensor, 512 bytes
    crc = tensors_checksum([torch.from_numpy(data)], algo)
    bad = data.copy()
    if corrupt == "flipped byte":
        bad[100] ^= 0x01
    else:  # what a word sum cannot see
        bad[0:8], bad[8:16] = data[8:16], data[0:8]
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ZmqWeightSubscriber(f"tcp://127.0.0.1:{port}", name="g0", timeout_s=2)
    stream_subscribed(pub, [sub])
    header = {"policy_version": 1, "index": 0, "crc": crc, "hash": algo, "nbytes": 512}
    header["tensors"] = [["w", "int64", [64], 0, 512]]
    for version, payload in ((1, data), (2, bad)):
        pub.send(wire.encode_map("weights_begin", {"policy_version": version}))
        pub.send_multipart(
            [wire.encode_map("weights_bucket", {**header, "policy_version": version}), payload[:256], payload[256:]]
        )
        pub.send(wire.encode_map("weights_end", {"policy_version": version, "num_buckets": 1, "bytes": 512}))
        if version == 1:  # the intact copy passes, cut into two frames
            update = receive_version(sub)
            assert torch.equal(dict(update.tensors)["w"], torch.arange(64))
            update.done()
    with pytest.raises(WeightSyncError, match=f"version 2 bucket 0: {algo} checksum mismatch"):
        receive_version(sub, served=1)
    pub.close()
    sub.close()


def test_zmq_timeout_names_what_it_waited_for():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ZmqWeightSubscriber(f"tcp://127.0.0.1:{port}", name="gen-3.weights", timeout_s=0.5)
    stream_subscribed(pub, [sub])
    pub.send(wire.encode_map("weights_begin", {"policy_version": 9}))  # ... and the learner goes silent
    with pytest.raises(
        TimeoutError, match=r"gen-3.weights: waited 0.5 s for bucket 0 \(or the end\) of version 9 from tcp://"
    ):
        receive_version(sub)
    pub.close()
    sub.close()


def _dying_subscriber(address, heard):
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 2)
    sock.setsockopt(zmq.RCVBUF, 1 << 16)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)  # every wait bounded: a failed test leaves no process behind
    sock.connect(address)
    while sock.recv_multipart() == [STREAM_PROBE]:  # the test's probes, until weights_begin
        heard.set()
    sock.recv_multipart()  # bucket 0
    os._exit(0)  # dies mid-broadcast, without closing anything


def test_a_subscriber_that_dies_mid_broadcast_does_not_block_the_others():
    # A publish held up by the dead subscriber would wait send_timeout_s per bucket (and count a
    # stall); the bound on its time is half of that, far above a loaded machine's 32 MiB copy.
    pub = ZmqWeightPublisher("tcp://127.0.0.1:0", send_timeout_s=60)
    heard = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=_dying_subscriber, args=(pub.address, heard))
    proc.start()
    live = ZmqWeightSubscriber(pub.address, name="live", timeout_s=60)
    wait_subscribed(
        lambda: pub.sock.send(STREAM_PROBE),
        lambda: heard.is_set() and has_message(live.sock),
        "the dying subscriber (a spawned process) and the live one to be subscribed",
        timeout=120,
    )
    sd = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(32)}  # 32 MiB in 1 MiB buckets

    got = {}

    def consume():
        got["update"] = receive_version(live, timeout=120)

    t = threading.Thread(target=consume)
    t.start()
    stats = pub.publish(state_dict_buckets(sd, 1 << 20), 1)
    t.join(120)
    proc.join(120)
    assert proc.exitcode == 0
    assert stats["seconds"] < 30 and pub.stalled == 0, stats
    assert all(torch.equal(dict(got["update"].tensors)[k], v) for k, v in sd.items())
    pub.close()
    live.close()


def test_zmq_copies_a_transient_bucket_into_at_most_two_packing_buffers():
    from asyncrl.weights.buckets import Bucket

    pub = ZmqWeightPublisher("tcp://127.0.0.1:0")
    sub = ZmqWeightSubscriber(pub.address, name="g0", timeout_s=10)
    stream_subscribed(pub.sock, [sub])
    sd = {f"w{i}": torch.full((1 << 16,), float(i)) for i in range(8)}  # 256 KiB each
    expected = {k: v.clone() for k, v in sd.items()}

    def gathered():  # like a ZeRO-3 gather: the tensors are gone once the next bucket is asked for
        for name, t in sd.items():
            bucket = Bucket([(name, t)])
            bucket.transient = True
            yield bucket
            t.zero_()

    stats = pub.publish(gathered(), 1)
    update = receive_version(sub)
    got = dict(update.tensors)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert 0 < stats["extra_bytes"] <= 2 * (1 << 18), stats  # two buckets of 256 KiB at most
    update.done()
    pub.close()
    sub.close()


@pytest.mark.parametrize("transient", [False, True])
def test_zmq_cuts_a_bucket_into_messages_at_tensor_boundaries(transient):
    """A 1 MiB bucket goes out as messages of at most 256 KiB (a larger tensor alone), so a
    subscriber starts on the first while the rest are on the wire; the version arrives whole."""
    from asyncrl.weights.buckets import Bucket

    pub = ZmqWeightPublisher("tcp://127.0.0.1:0", frame_bytes=1 << 16, message_bytes=1 << 18)
    sub = ZmqWeightSubscriber(pub.address, name="g0", timeout_s=10)
    stream_subscribed(pub.sock, [sub])
    sizes = [1 << 15] * 6 + [1 << 17] + [1 << 15] * 2  # floats: 128 KiB x6, 512 KiB (alone), 128 KiB x2
    sd = {f"w{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}
    bucket = Bucket(list(sd.items()))
    bucket.transient = transient
    stats = pub.publish([bucket], 1)
    update = receive_version(sub)
    got = dict(update.tensors)
    assert list(got) == list(sd) and all(torch.equal(got[k], v) for k, v in sd.items())
    assert stats["buckets"] == 5  # [w0 w1] [w2 w3] [w4 w5] [w6] [w7 w8]
    update.done()
    pub.close()
    sub.close()


def test_zmq_tensors_arrive_bit_identical_in_buffers_the_next_version_reuses():
    """Every tensor, one that fills a frame as one cut into frames, is checked and copied into
    its bucket's buffer: every dtype arrives bit-identical, and once the update is done the next
    version is received into the same buffers (its tensors are valid only until then)."""
    frame = 1 << 16
    pub = ZmqWeightPublisher("tcp://127.0.0.1:0", frame_bytes=frame)
    sub = ZmqWeightSubscriber(pub.address, name="g0", timeout_s=10)
    stream_subscribed(pub.sock, [sub])
    g = torch.Generator().manual_seed(0)
    sd = {
        "one_frame": torch.randn(frame // 4, generator=g),  # 64 KiB: exactly one frame
        "cut": torch.randn(50_000, generator=g),  # 200 KB: four frames
        "bf16_odd": torch.randn(3, 333, generator=g).to(torch.bfloat16),
        "small_int": torch.arange(3, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    pub.publish(state_dict_buckets(sd, 1 << 20), 1)
    update = receive_version(sub)
    got = dict(update.tensors)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in sd.items())
    first = {k: got[k] for k in ("one_frame", "cut")}
    update.done()  # its receive buffers go to the next version
    sd2 = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    pub.publish(state_dict_buckets(sd2, 1 << 20), 2)
    update2 = receive_version(sub, served=1)
    for k, t in first.items():  # views of the reused buffers: overwritten, as documented
        assert torch.equal(t, sd2[k]) and torch.equal(dict(update2.tensors)[k], sd2[k])
    update2.done()
    pub.close()
    sub.close()


def test_shm_removes_what_a_killed_publisher_left_behind(tmp_path):
    (tmp_path / "asyncrl-weights-1-deadbeef" / "v000001").mkdir(parents=True)
    (tmp_path / "asyncrl-weights-1-deadbeef" / ".lock").touch()  # its owner is gone: no flock on it
    live = ShmWeightPublisher("tcp://127.0.0.1:0", root=tmp_path)
    pub = ShmWeightPublisher("tcp://127.0.0.1:0", root=tmp_path)
    assert not (tmp_path / "asyncrl-weights-1-deadbeef").exists()
    assert live.dir.exists() and pub.dir.exists()  # a live publisher's directory stays
    live.close()
    pub.close()


@pytest.mark.gpu
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_state_dict_on_the_gpu_arrives_bit_identical(transport):
    """The learner's weights on its GPU: each bucket is packed device to host in one copy; one GPU
    is enough."""
    assert torch.cuda.is_available(), "this test needs CUDA (selected by -m gpu)"
    Pub, Sub = TRANSPORTS[transport]
    pub = Pub("tcp://127.0.0.1:0")
    sub = Sub(pub.address, name="g0")
    if transport == "zmq":
        stream_subscribed(pub.sock, [sub])
    sd = {k: v.cuda() for k, v in _state().items()}
    stats = pub.publish(state_dict_buckets(sd, 64 << 10), 1)
    update = receive_version(sub, pub)
    got = dict(update.tensors)
    assert stats["buckets"] >= 3 and list(got) == list(sd)
    for name, t in sd.items():
        assert got[name].device.type == "cpu" and torch.equal(got[name], t.cpu()), name
    update.done()
    pub.close()
    sub.close()


def test_the_zmq_stream_defaults_to_fletcher64_and_the_summing_transports_to_sum64():
    from asyncrl.weights.config import WeightSyncConfig

    assert WeightSyncConfig(transport="zmq").checksum == "fletcher64"
    assert WeightSyncConfig(transport="zmq", checksum="crc32").checksum == "crc32"
    assert WeightSyncConfig(transport="shm").checksum == "sum64"
    assert WeightSyncConfig().checksum == "sum64"


def test_the_stream_counts_frames_over_the_size_limit_and_refused_handshakes(tmp_path):
    from asyncrl.observability.metrics import REGISTRY
    from asyncrl.wire import security
    from asyncrl.wire.security import MessageLimits, SecurityConfig, write_keys

    write_keys(tmp_path / "keys")
    security.configure(
        SecurityConfig(curve=True, keys_dir=str(tmp_path / "keys"), max_message_bytes=MessageLimits(subscribe=4096))
    )
    try:
        pub = ZmqWeightPublisher("tcp://127.0.0.1:0", name="test.stream.pub", frame_bytes=1 << 16, send_timeout_s=5)
        sub = ZmqWeightSubscriber(pub.address, name="test.stream.sub", timeout_s=5)
        wait_until(
            lambda: pub.publish(state_dict_buckets(_state(), 1 << 16), 1) and sub.rejected > 0,
            "the subscriber to refuse a 64 KiB frame over its 4 KiB limit",
        )
        assert REGISTRY.get_sample_value(
            "asyncrl_rejected_frames_total", {"socket": "test.stream.sub", "reason": "oversized"}
        )
        # libzmq dropped that connection for good; the subscriber connects again and hears the
        # next version whose frames fit.
        small = {"w": torch.arange(4.0)}
        got = wait_until(
            lambda: pub.publish(state_dict_buckets(small, 1 << 16), 2) and sub.newest(1, timeout=0.2),
            "the subscriber to connect again and take a version of small frames",
        )
        assert torch.equal(dict(got.tensors)["w"], small["w"])
        got.done()
        stranger = zmq.Context.instance().socket(zmq.SUB)  # no CURVE key at all
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(pub.address)
        wait_until(
            lambda: REGISTRY.get_sample_value("asyncrl_auth_failures_total", {"socket": "test.stream.pub"}),
            "the publisher to count the refused handshake",
        )
        stranger.close()
        pub.close()
        sub.close()
    finally:
        security.reset()


@pytest.mark.parametrize("transient", [False, True])
def test_zmq_queues_up_to_a_window_of_view_buckets_and_one_packed_bucket(monkeypatch, transient):
    """Buckets of the model's own tensors go out WINDOW at a time (libzmq always has the next one
    queued); a bucket packed into a buffer waits for the one before it (two buffers at most)."""
    from asyncrl.weights import stream
    from asyncrl.weights.buckets import Bucket

    pub = ZmqWeightPublisher("tcp://127.0.0.1:0")
    sub = ZmqWeightSubscriber(pub.address, name="g0", timeout_s=10)
    stream_subscribed(pub.sock, [sub])
    sd = {f"w{i}": torch.full((1 << 12,), float(i)) for i in range(3 * stream.WINDOW)}  # 16 KiB each
    sent, finished, in_flight = [0], [0], []
    checksum, finish = stream.tensors_checksum, pub._finish

    def counting_checksum(views, algo):  # called once per bucket, after the buckets before it went out
        in_flight.append(sent[0] - finished[0])
        sent[0] += 1
        return checksum(views, algo)

    def counting_finish(version, item):
        finished[0] += 1
        finish(version, item)

    monkeypatch.setattr(stream, "tensors_checksum", counting_checksum)
    monkeypatch.setattr(pub, "_finish", counting_finish)

    def buckets():
        for name, t in sd.items():
            bucket = Bucket([(name, t)])
            bucket.transient = transient
            yield bucket

    pub.publish(buckets(), 1)
    update = receive_version(sub)
    assert all(torch.equal(dict(update.tensors)[k], v) for k, v in sd.items())
    assert finished[0] == len(sd)
    assert max(in_flight) == (1 if transient else stream.WINDOW), in_flight
    update.done()
    pub.close()
    sub.close()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_weights_published_in_bfloat16_arrive_as_the_engine_would_cast_them_in_half_the_bytes(transport):
    from asyncrl.weights.buckets import cast_buckets

    Pub, Sub = TRANSPORTS[transport]
    pub = Pub("tcp://127.0.0.1:0")
    sub = Sub(pub.address, name="g0")
    if transport == "zmq":
        stream_subscribed(pub.sock, [sub])
    sd = {k: v for k, v in _state().items() if v.dtype in (torch.float32, torch.int64)}
    as_is = pub.publish(state_dict_buckets(sd, 64 << 10), 1)
    receive_version(sub, pub).done()
    cast = pub.publish(cast_buckets(state_dict_buckets(sd, 64 << 10), "bfloat16"), 2)
    update = receive_version(sub, pub, served=1)
    got = dict(update.tensors)
    for name, t in sd.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t  # what vLLM's bf16 load makes of t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    update.done()
    floats = sum(t.numel() * 4 for t in sd.values() if t.is_floating_point())
    assert as_is["bytes"] - cast["bytes"] >= floats / 2 * 0.99  # the floats' bytes halved (alignment aside)
    pub.close()
    sub.close()
