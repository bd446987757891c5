import logging
import stat

import pytest
import zmq
import zmq.auth

from asyncrl.config import RunConfig, dump_config
from asyncrl.observability.metrics import REGISTRY
from asyncrl.wire import security
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import GoCommand, Prompts, ReadyEvent, WantPrompts
from asyncrl.wire.security import SecurityConfig, write_keys
from asyncrl.wire.sockets import Publisher, ReplyServer, RequestClient, StreamReceiver, StreamSender, Subscriber
from tests.waits import wait_until

ROW = {"group_id": "g", "prompt_uid": "p", "text": "p", "answer": "", "task": "addition"}


def auth_failures(socket: str) -> float:
    return REGISTRY.get_sample_value("asyncrl_auth_failures_total", {"socket": socket}) or 0.0


def secret_of(path) -> bytes:
    return zmq.auth.load_certificate(path)[1]


@pytest.fixture
def keys(tmp_path):
    write_keys(tmp_path / "keys")
    security.configure(SecurityConfig(curve=True, keys_dir=str(tmp_path / "keys")))
    yield tmp_path / "keys"
    security.reset()


def raw_push(address: str, pair=None, server_key: bytes | None = None) -> zmq.Socket:
    """A client that is not an asyncrl socket: no key, or the key pair and server key given."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if pair is not None:
        sock.curve_publickey, sock.curve_secretkey = pair
        sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


def test_keys_writes_pairs_with_private_secrets_and_authorizes_clients(tmp_path):
    out = write_keys(tmp_path / "k", ["client", "other-host"])
    assert sorted(out) == ["client", "other-host", "server"]
    for name in out:
        secret = tmp_path / "k" / f"{name}.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert secret_of(secret) is not None
    assert sorted(p.name for p in (tmp_path / "k" / "authorized").iterdir()) == ["client.key", "other-host.key"]
    with pytest.raises(FileExistsError, match="refusing to replace"):
        write_keys(tmp_path / "k")
    write_keys(tmp_path / "k", force=True)


def test_curve_needs_a_key_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="asyncrl keys"):
        security.configure(SecurityConfig(curve=True, keys_dir=str(tmp_path / "none")))


def test_config_dump_holds_the_key_path_not_the_keys(keys):
    text = dump_config(RunConfig(security={"curve": True, "keys_dir": str(keys)}))
    assert str(keys) in text
    for name in ("server", "client"):
        assert secret_of(keys / f"{name}.key_secret").decode() not in text


def test_scope_cross_host_leaves_loopback_sockets_plain(keys):
    security.configure(SecurityConfig(curve=True, keys_dir=str(keys), scope="cross_host"))
    assert not security.uses_curve("tcp://127.0.0.1:5555") and not security.uses_curve("ipc:///tmp/x")
    assert security.uses_curve("tcp://10.1.2.3:5555") and security.uses_curve("tcp://*:5555")
    rx = StreamReceiver("tcp://127.0.0.1:*", name="test.local")
    tx = raw_push(rx.address)  # no key needed on loopback
    tx.send(b"\x00not msgpack")
    assert rx.recv(timeout=2) is None and rx.rejected == 1  # delivered (and rejected by the decoder)
    tx.close()
    rx.close()


def test_every_allocated_endpoint_is_on_loopback():
    assert all(security.is_local(a) for a in Endpoints.allocate().model_dump().values() if a)


def test_curve_round_trips_on_every_socket_pair(keys):
    rx = StreamReceiver("tcp://127.0.0.1:*", name="test.curve.rx")
    tx = StreamSender(rx.address, name="test.curve.tx")
    assert rx.curve and tx.curve
    tx.send(ReadyEvent(version=1), timeout=5)
    assert rx.recv(timeout=5) == ("event", ReadyEvent(version=1))

    server = ReplyServer("tcp://127.0.0.1:*", name="test.curve.server")
    client = RequestClient(server.address, name="test.curve.client")
    assert client.request(WantPrompts(generator="g", max_prompts=1), timeout=0.5) is None
    who, kind, body = server.recv(timeout=5)
    server.reply(who, Prompts(prompts=[ROW]), body.request_id)
    assert client.receive(timeout=5)[1].prompts == [ROW]

    pub = Publisher("tcp://127.0.0.1:*", name="test.curve.pub")
    sub = Subscriber(pub.address, name="test.curve.sub")
    # A slow joiner misses early messages: repeat until one arrives.
    got = wait_until(lambda: pub.send(GoCommand()) or sub.recv(timeout=0.05), "the subscriber to hear the publisher")
    assert got == ("control", GoCommand())
    for s in (tx, rx, client, server, sub, pub):
        s.close()


def test_clients_without_the_right_keys_are_refused_and_counted(keys, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    rx = StreamReceiver("tcp://127.0.0.1:*", name="test.curve.guarded")
    server_public = zmq.auth.load_certificate(keys / "server.key")[0]
    stranger = zmq.auth.load_certificate(write_keys(tmp_path / "stranger")["client"].with_suffix(".key_secret"))
    client = zmq.auth.load_certificate(keys / "client.key_secret")
    wrong_server = stranger[0]
    attempts = [
        raw_push(rx.address),  # no key at all
        raw_push(rx.address, stranger, server_public),  # a key the server does not admit
        raw_push(rx.address, client, wrong_server),  # the right pair, the wrong server key
    ]
    for sock in attempts:
        before = auth_failures("test.curve.guarded")
        try:
            sock.send(b"\x00let me in", zmq.NOBLOCK)  # queued while the handshake runs, never delivered
        except zmq.Again:
            pass
        # Counters move on the watcher thread: poll for the condition instead of sleeping.
        wait_until(lambda b=before: auth_failures("test.curve.guarded") > b, "the refusal to be counted")
        sock.close()
    assert rx.recv(timeout=0.3) is None and rx.rejected == 0  # nothing got through to be decoded

    good = StreamSender(rx.address, name="test.curve.good")  # the server keeps serving keyed clients
    good.send(ReadyEvent(version=2), timeout=5)
    assert rx.recv(timeout=5) == ("event", ReadyEvent(version=2))
    assert caplog.text.count("failed the CURVE handshake") == 1  # logged once, counted every time
    for name in ("server", "client"):
        assert secret_of(keys / f"{name}.key_secret").decode() not in caplog.text
    good.close()
    rx.close()


def test_the_keys_command_writes_them_and_prints_paths_only(tmp_path, capsys):
    from asyncrl.cli import main

    assert main(["keys", str(tmp_path / "k"), "--clients", "a", "b"]) == 0
    out = capsys.readouterr().out
    assert "server.key" in out and "a.key" in out and "b.key" in out
    assert secret_of(tmp_path / "k" / "server.key_secret").decode() not in out
    with pytest.raises(SystemExit, match="refusing to replace"):
        main(["keys", str(tmp_path / "k")])
