"""Joining a CURVE run by address: the request for the run's config already goes over CURVE with
this host's keys, which then stand in for the run's paths; without keys the owner answers nothing."""

import threading

import pytest

from asyncrl.config import RunConfig
from asyncrl.fleet.join import fetch_run, join_context, split_security
from asyncrl.wire import security
from asyncrl.wire.endpoints import Endpoints, free_ports
from asyncrl.wire.messages import Run, WantRun
from asyncrl.wire.security import write_keys
from asyncrl.wire.sockets import ReplyServer, tcp_address


@pytest.fixture
def curve_owner(tmp_path):
    """A stand-in for the owner reward worker's ``reward_share`` socket, CURVE on, answering WantRun."""
    keys = tmp_path / "keys"
    write_keys(keys, clients=["client", "gpu-a"])
    run_cfg = RunConfig(learner={"batch_groups": 3}, security={"curve": True, "keys_dir": "/elsewhere/keys"})
    endpoints = Endpoints.allocate()
    address = tcp_address(free_ports(1)[0])
    security.configure(security.SecurityConfig(curve=True, keys_dir=str(keys)))
    stop, bound = threading.Event(), threading.Event()

    def serve():
        server = ReplyServer(address, name="owner.share")
        bound.set()
        while not stop.is_set():
            got = server.recv(0.1)
            if got is not None and isinstance(got[2], WantRun):
                run = Run(config=run_cfg.model_dump(mode="json"), endpoints=endpoints.model_dump())
                server.reply(got[0], run, got[2].request_id)
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert bound.wait(10)
    yield address, keys
    stop.set()
    thread.join(5)
    security.reset()


def test_a_process_with_this_hosts_keys_joins_a_curve_run_by_address(curve_owner):
    address, keys = curve_owner
    own = {"curve": "true", "keys_dir": str(keys), "client_key": "gpu-a"}
    ctx = join_context("reward", "reward-hot", address, own)
    try:
        assert ctx.cfg.learner.batch_groups == 3  # the run's config, fetched over CURVE
        assert ctx.cfg.security.curve and ctx.cfg.security.keys_dir == str(keys)
        assert ctx.cfg.security.client_key == "gpu-a"  # this host's pair, not the run's paths
    finally:
        ctx.close()


def test_without_keys_the_curve_owner_answers_nothing(curve_owner):
    address, _ = curve_owner
    security.configure(security.SecurityConfig())  # a plain client: the handshake fails
    with pytest.raises(SystemExit, match=r"no reward worker answered at .* within 2 s"):
        fetch_run(address, timeout=2)


def test_a_joining_process_sets_only_its_own_security_keys():
    own, rest = split_security(["security.curve=true", "security.client_key=gpu-a", "reward.concurrency=8"])
    assert own == {"curve": "true", "client_key": "gpu-a"} and rest == ["reward.concurrency=8"]
    with pytest.raises(SystemExit, match=r"\(security.max_message_bytes.batch=1\) may set only security"):
        split_security(["security.max_message_bytes.batch=1"])
