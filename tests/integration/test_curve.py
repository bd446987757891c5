"""A real buffer process with CURVE on: keyed clients (the test, playing controller, reward worker
and learner) are served; a client without the key is refused and counted, and the buffer keeps
serving; no key reaches its log or the run's config.yaml."""

import urllib.request

import pytest
import zmq
import zmq.auth

from asyncrl import wire
from asyncrl.config import RunConfig
from asyncrl.wire import security
from asyncrl.wire.messages import WantBatch
from asyncrl.wire.security import write_keys
from asyncrl.wire.sockets import RequestClient, StreamSender
from tests.factories import make_group
from tests.integration.harness import Harness, metric
from tests.waits import wait_until

pytestmark = pytest.mark.slow  # a real buffer process


@pytest.fixture
def curve_run(tmp_path):
    keys = tmp_path / "keys"
    write_keys(keys)
    cfg = RunConfig(
        buffer={"max_staleness": None},
        learner={"batch_groups": 1},
        sampling={"n": 4},
        security={"curve": True, "keys_dir": str(keys)},
    )
    security.configure(cfg.security)  # the test's own sockets, the harness's included, use CURVE
    h = Harness(tmp_path / "run", cfg)
    h.start("buffer", "buffer")
    yield h, keys
    h.close()
    security.reset()


def test_a_curve_run_serves_keyed_clients_and_refuses_and_counts_others(curve_run):
    h, keys = curve_run
    h.wait_for("buffer", "ready")  # its events came in over CURVE
    port = int((h.run_dir / "metrics" / "buffer.port").read_text())

    intruder = zmq.Context.instance().socket(zmq.PUSH)  # no key: the handshake fails
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.connect(h.endpoints.buffer_in)
    try:
        intruder.send(wire.encode_group(make_group("intruder", rewards=[1.0] * 4)), zmq.NOBLOCK)
    except zmq.Again:
        pass  # never connected: nothing to queue it on
    wait_until(
        lambda: metric(port, "asyncrl_auth_failures_total", 'socket="buffer.in"') >= 1,
        "buffer.in to count the refused client",
        interval=0.1,
    )
    intruder.close()

    to_buffer = StreamSender(h.endpoints.buffer_in, name="test.to_buffer")
    to_buffer.send_frame(wire.encode_group(make_group("keyed", rewards=[1.0, 0.0, 0.0, 1.0])), timeout=10)
    learner = RequestClient(h.endpoints.buffer_requests, name="test.learner")
    reply = learner.request(WantBatch(num_groups=1, policy_version=0, timeout_s=20), timeout=20)
    assert reply is not None and [g.group_id for g in reply[1].groups] == ["keyed"]  # the intruder's never came
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read() == b"ok\n"

    finals = h.stop(["buffer"], ["buffer"])
    assert finals["buffer"].sampled == 4
    log = (h.run_dir / "buffer.log").read_text()
    assert log.count("failed the CURVE handshake") == 1, log
    config = (h.run_dir / "config.yaml").read_text()
    assert str(keys) in config
    for name in ("server", "client"):
        secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")[1].decode()
        assert secret not in log and secret not in config
    learner.close()
    to_buffer.close()
