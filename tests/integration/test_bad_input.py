"""Bad frames sent to the real reward worker and buffer processes (garbage, a wrong schema, NaN
logprobs, a frame over the run's size limit) are rejected, counted in a metric, logged once with
the reason, and the processes keep serving."""

import math
import urllib.request

import msgpack
import numpy as np
import pytest

from asyncrl import wire
from asyncrl.config import RunConfig
from asyncrl.observability.inspect_run import inspect_run
from asyncrl.wire.messages import WantBatch
from asyncrl.wire.sockets import RequestClient, StreamSender
from tests.factories import make_group
from tests.integration.harness import Harness, metric
from tests.waits import wait_until

pytestmark = pytest.mark.slow  # real reward worker and buffer processes

LIMIT = 64 << 10  # the stream limit of this run: groups of the test are < 1 KiB


def bad_frames() -> list[bytes]:
    nan_group = make_group("nan")
    nan_group.samples[0].logprobs = np.array([math.nan, -1.0, -1.0], dtype=np.float32)
    return [
        b"\x00\xffnot msgpack at all",
        msgpack.packb({"schema": wire.SCHEMA_VERSION + 1, "kind": "group", "group": {}}),
        wire.encode_group(nan_group),
        wire.encode_group(nan_group),  # a second NaN: counted again, not logged again
    ]


@pytest.fixture
def stream(tmp_path):
    cfg = RunConfig(
        buffer={"max_staleness": None},
        learner={"batch_groups": 2},
        sampling={"n": 4},
        security={"max_message_bytes": {"stream": LIMIT}},
    )
    h = Harness(tmp_path, cfg)
    h.start("buffer", "buffer")
    h.start("reward", "reward-0")
    h.wait_for("buffer", "ready")
    h.wait_for("reward-0", "ready")
    yield h
    h.close()


def test_bad_frames_are_rejected_counted_logged_once_and_serving_goes_on(stream, tmp_path):
    h = stream
    to_reward = StreamSender(h.endpoints.reward_in, name="test.to_reward")
    to_buffer = StreamSender(h.endpoints.buffer_in, name="test.to_buffer")
    for frame in bad_frames():
        to_reward.send_frame(frame, timeout=5)
        to_buffer.send_frame(frame, timeout=5)
    # Good groups after the bad ones still flow: one scored by the reward worker, one direct.
    good = make_group("good")
    good.answer = "0"  # sample texts are "0".."3": sample 0 is right
    to_reward.send_frame(wire.encode_group(good), timeout=5)
    to_buffer.send_frame(wire.encode_group(make_group("direct", rewards=[1.0, 0.0, 0.0, 1.0])), timeout=5)

    learner = RequestClient(h.endpoints.buffer_requests, name="test.learner")
    reply = learner.request(WantBatch(num_groups=2, policy_version=0, timeout_s=20), timeout=20)
    assert reply is not None and reply[0] == "batch"
    groups = {g.group_id: g for g in reply[1].groups}
    assert set(groups) == {"good", "direct"}
    assert [s.reward for s in groups["good"].samples] == [1.0, 0.0, 0.0, 0.0]

    # An oversized frame, on a connection of its own: ZeroMQ cuts that connection before
    # buffering the frame (anything queued behind it on the same connection would go with it).
    for address, label in ((h.endpoints.reward_in, "reward"), (h.endpoints.buffer_in, "buffer")):
        big = StreamSender(address, name=f"test.big_to_{label}")
        big.send_frame(wire.encode_map("event", {"blob": b"x" * (2 * LIMIT)}), timeout=5)
        port = int((tmp_path / "metrics" / f"{'reward-0' if label == 'reward' else 'buffer'}.port").read_text())
        socket = f"{label}.in"
        wait_until(
            lambda port=port, socket=socket: (
                metric(port, "asyncrl_rejected_frames_total", f'reason="oversized",socket="{socket}"') >= 1
            ),
            f"{socket} to count the oversized frame",
            interval=0.1,
        )
        big.close()

    for name, socket in (("reward-0", "reward.in"), ("buffer", "buffer.in")):
        port = int((tmp_path / "metrics" / f"{name}.port").read_text())
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read() == b"ok\n"
        assert metric(port, "asyncrl_rejected_frames_total", f'reason="oversized",socket="{socket}"') == 1
        assert metric(port, "asyncrl_rejected_frames_total", f'reason="malformed",socket="{socket}"') == 1
        assert metric(port, "asyncrl_rejected_frames_total", f'reason="bad_schema",socket="{socket}"') == 1
        assert metric(port, "asyncrl_rejected_frames_total", f'reason="nonfinite_logprobs",socket="{socket}"') == 2

    live = inspect_run(tmp_path)  # what `asyncrl inspect` shows while they run
    assert live["buffer"]["up"] and live["reward-0"]["up"] and live["reward-0"]["rejected_frames"] == 5

    finals = h.stop(["reward"], ["reward-0"])
    finals.update(h.stop(["buffer"], ["buffer"]))
    assert finals["reward-0"].rejected_frames == 5 and finals["reward-0"].forwarded == 4
    assert finals["buffer"].sampled == 8 and finals["buffer"].held == 0
    for name in ("reward-0", "buffer"):
        log = (tmp_path / f"{name}.log").read_text()
        assert log.count("rejected a frame (nonfinite_logprobs") == 1, log  # logged once, counted twice
        assert log.count("rejected a frame (bad_schema") == 1 and log.count("rejected a frame (malformed") == 1
        assert log.count("rejected a frame (oversized") == 1
    learner.close()
    to_reward.close()
    to_buffer.close()
