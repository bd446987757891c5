"""Partial rollouts at the buffer (``generator.partial_rollouts: mask``): the gate measures a group
from its newest segment, and each hand-out masks exactly the tokens past the staleness bound."""

import threading

import pytest

from asyncrl import wire
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.buffer.service import BufferService
from asyncrl.buffer.stale_segments import gate_version, mark_trained_from, newest_version
from asyncrl.wire.messages import WantBatch
from asyncrl.wire.sockets import Publisher, ReplyServer, RequestClient, StreamReceiver, StreamSender, tcp_address
from tests.factories import make_group
from tests.waits import wait_until


def spanning(group_id="g", version=1, segments=([[0, 1], [2, 3], [4, 5]], None, [[0, 2]])):
    """A group of three 6-token answers sampled from ``version`` on, with these segments."""
    group = make_group(group_id, n=len(segments), version=version, rewards=[1.0, 0.0, 1.0][: len(segments)], length=6)
    for sample, seg in zip(group.samples, segments):
        sample.version_segments = None if seg is None else [list(s) for s in seg]
    return group


def test_each_token_is_trained_only_within_the_bound():
    group = spanning()
    counts = mark_trained_from([group], learner_version=6, max_staleness=3)  # versions 3.. are trainable
    assert [s.trained_from for s in group.samples] == [2, 6, 6]
    assert (counts.tokens, counts.samples) == (2 + 6 + 6, 2)
    counts = mark_trained_from([group], learner_version=5, max_staleness=3)  # 2.. : set afresh
    assert [s.trained_from for s in group.samples] == [2, 6, 0]
    mark_trained_from([group], learner_version=9, max_staleness=None)
    assert [s.trained_from for s in group.samples] == [0, 0, 0]
    wire.validate_group(group)


def test_the_gate_measures_from_the_oldest_token_or_from_the_newest_segment():
    group = spanning()
    assert newest_version(group) == 5
    assert gate_version(group, "off") == 1 and gate_version(group, "mask") == gate_version(group, "resume") == 5


@pytest.mark.parametrize("mode, kept", [("off", False), ("mask", True)])
def test_a_group_with_a_segment_within_the_bound_is_kept_only_when_stale_segments_are_masked(mode, kept):
    buf = ReplayBuffer.from_config(BufferConfig(max_staleness=2), partial_rollouts=mode)
    buf.set_learner_version(6)
    assert (buf.insert(spanning("a")) is not None) is kept  # oldest 1, newest 5
    assert buf.insert(spanning("b", segments=([[0, 1], [3, 3]],))) is None  # nothing within 2 of 6
    assert buf.dropped["stale"] == (0 if kept else 3) + 1  # in samples
    if kept:
        buf.set_learner_version(8)  # its newest segment is now past the bound too
        assert len(buf) == 0 and buf.dropped["stale"] == 1 + 3


def test_a_batch_handed_out_masks_the_segments_too_stale_for_the_learners_version():
    buf = ReplayBuffer.from_config(
        BufferConfig(capacity_samples=64, max_staleness=3, min_size_to_sample=1), partial_rollouts="mask"
    )
    service = BufferService(
        buf,
        StreamReceiver(tcp_address(0), name="test.buffer.in"),
        ReplyServer(tcp_address(0), name="test.buffer.requests"),
        Publisher(tcp_address(0), name="test.buffer.status"),
    )
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop.is_set,), daemon=True)
    producer = StreamSender(service.inbox.address, name="test.producer")
    learner = RequestClient(service.requests.address, name="test.learner")
    thread.start()
    try:
        producer.send_frame(wire.encode_group(spanning("a")), timeout=5)
        wait_until(lambda: len(buf) == 1, "the group to be stored")
        reply = learner.request(WantBatch(num_groups=1, policy_version=6, timeout_s=5.0), timeout=5.0)
        (group,) = reply[1].groups
        assert [s.trained_from for s in group.samples] == [2, 6, 6]  # on the wire, as the learner gets it
    finally:
        stop.set()
        thread.join(5)
        for sock in (producer, learner, service.inbox, service.requests, service.status):
            sock.close()
