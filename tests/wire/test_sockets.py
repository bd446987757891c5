import msgpack
import pytest
import zmq

from asyncrl import wire
from asyncrl.observability.metrics import REGISTRY
from asyncrl.wire import security
from asyncrl.wire.messages import ErrorEvent, Prompts, ReadyEvent, WantPrompts, WeightsAnnouncement
from asyncrl.wire.security import SecurityConfig
from asyncrl.wire.sockets import Publisher, ReplyServer, RequestClient, StreamReceiver, StreamSender, Subscriber
from tests.factories import make_group
from tests.waits import wait_until


def test_push_pull_carries_groups_and_skips_bad_frames():
    rx = StreamReceiver("tcp://127.0.0.1:*", name="test.rx")
    tx = StreamSender(rx.address, name="test.tx")
    tx.send_frame(b"not msgpack")
    tx.send_frame(msgpack.packb({"schema": 999, "kind": "group"}))
    tx.send_frame(wire.encode_group(make_group("good")))
    kind, body = rx.recv(timeout=5)
    assert kind == "group" and body.group.group_id == "good"
    assert rx.rejected == 2
    assert rx.recv(timeout=0.05) is None
    tx.close()
    rx.close()


def test_send_times_out_when_no_receiver_takes_frames():
    tx = StreamSender("tcp://127.0.0.1:1", name="test.nobody")  # connects lazily; no peer ever
    with pytest.raises(TimeoutError):
        tx.send(ReadyEvent(version=1), timeout=0.2)
    tx.close()


def test_oversized_frames_are_refused_by_the_socket_and_counted():
    rx = StreamReceiver("tcp://127.0.0.1:*", name="test.small", max_message_bytes=1024)
    tx = StreamSender(rx.address, name="test.big")
    tx.send(ErrorEvent(error="x" * 4096))
    assert rx.recv(timeout=0.5) is None  # ZeroMQ cut the peer instead of buffering 4 KiB
    # The cut is seen on the socket's monitor once the sender has reconnected by itself.
    wait_until(lambda: rx.rejected, "the receiver's monitor to count the cut peer", interval=0.05)
    assert rx.rejected == 1
    assert (
        REGISTRY.get_sample_value("asyncrl_rejected_frames_total", {"socket": "test.small", "reason": "oversized"}) == 1
    )
    tx.send(ReadyEvent(version=3))  # the receiver, and the reconnected sender, keep going
    assert rx.recv(timeout=5) == ("event", ReadyEvent(version=3)) and rx.rejected == 1
    tx.close()
    rx.close()


def test_the_limit_comes_from_the_security_settings_per_kind_of_socket():
    security.configure(SecurityConfig(max_message_bytes={"stream": 2048, "reply": 4096}))
    try:
        rx = StreamReceiver("tcp://127.0.0.1:*", name="test.limit.rx")
        client = RequestClient("tcp://127.0.0.1:1", name="test.limit.client")
        assert rx.sock.getsockopt(zmq.MAXMSGSIZE) == rx.max_message_bytes == 2048
        assert client.sock.getsockopt(zmq.MAXMSGSIZE) == 4096
        big = wire.encode_map("event", {"blob": b"x" * 3000})
        assert rx._decode(big) is None and rx.rejected == 1  # the decode-time check agrees with ZeroMQ's
        rx.close()
        client.close()
    finally:
        security.reset()


def row(text: str) -> dict:
    return {"group_id": text, "prompt_uid": text, "text": text, "answer": "", "task": "addition"}


def test_a_late_reply_is_returned_by_the_next_request_not_dropped():
    server = ReplyServer("tcp://127.0.0.1:*", name="test.server")
    client = RequestClient(server.address, name="test.client")
    assert client.request(WantPrompts(generator="g", max_prompts=1), timeout=0.2) is None  # unanswered: times out
    who, _kind, body = server.recv(timeout=1)
    server.reply(who, Prompts(prompts=[row("late")]), body.request_id)
    kind, reply = client.request(WantPrompts(generator="g", max_prompts=1), timeout=5)
    assert kind == "prompts" and reply.prompts == [row("late")] and reply.request_id == 1
    who, _kind, body = server.recv(timeout=1)
    server.reply(who, Prompts(prompts=[row("fresh")]), body.request_id)
    kind, reply = client.request(WantPrompts(generator="g", max_prompts=1), timeout=5)
    assert reply.prompts == [row("fresh")] and reply.request_id == 2
    who, _kind, body = server.recv(timeout=1)  # request 3 timed out on the client side ...
    server.reply(who, Prompts(prompts=[row("last")]), body.request_id)
    kind, reply = client.receive(timeout=5)  # ... and its answer is still collected
    assert reply.prompts == [row("last")] and reply.request_id == 3
    client.close()
    server.close()


def test_publisher_reaches_subscribers_that_joined():
    pub = Publisher("tcp://127.0.0.1:*", name="test.pub")
    sub = Subscriber(pub.address, name="test.sub")
    # A slow joiner misses early messages: repeat until one arrives.
    got = wait_until(
        lambda: pub.send(WeightsAnnouncement(policy_version=3, path="/x")) or sub.recv(timeout=0.05),
        "the subscriber to hear the publisher",
    )
    assert got == ("weights", {"policy_version": 3, "path": "/x"})
    pub.close()
    sub.close()


def test_a_subscriber_hears_again_after_a_frame_too_big_for_it():
    # libzmq ends a connecting socket's connection over an oversized frame and never reconnects
    # it: the subscriber must connect again itself, or it stays deaf to every later message.
    pub = Publisher("tcp://127.0.0.1:*", name="test.pub.big")
    sub = Subscriber(pub.address, name="test.sub.small", max_message_bytes=1024)
    wait_until(lambda: pub.send(ReadyEvent(version=1)) or sub.recv(timeout=0.05), "the subscriber to join")
    pub.send(ErrorEvent(error="x" * 4096))
    wait_until(lambda: sub.recv(timeout=0.05) is None and sub.rejected, "the subscriber to count the refused frame")
    got = wait_until(
        lambda: pub.send(ReadyEvent(version=2)) or sub.recv(timeout=0.05), "the subscriber to hear the publisher again"
    )
    assert got == ("event", ReadyEvent(version=2)) and sub.rejected == 1
    pub.close()
    sub.close()


def test_a_client_gets_replies_again_after_a_reply_too_big_for_it():
    server = ReplyServer("tcp://127.0.0.1:*", name="test.server.big")
    client = RequestClient(server.address, name="test.client.small", max_message_bytes=1024)

    def serve(reply):
        got = server.recv(timeout=0.05)
        if got is not None:
            server.reply(got[0], reply, got[2].request_id)
        return got

    def serve_too_big():
        got = server.recv(timeout=0.05)
        if got is not None:
            server.sock.send_multipart([got[0], wire.encode_map("event", {"blob": b"x" * 4096})])
        return got

    assert client.request(WantPrompts(generator="g"), timeout=0.05) is None
    wait_until(serve_too_big, "the server to take the first request")
    wait_until(lambda: client.receive(timeout=0.05) is None and client.rejected, "the client to count the refusal")

    def ask():  # a request lost with the cut connection is asked again, as the roles' loops do
        reply = client.request(WantPrompts(generator="g"), timeout=0.05)
        return reply or (serve(Prompts()) and client.receive(timeout=0.5))

    kind, body = wait_until(ask, "the client to get a reply again")
    assert kind == "prompts" and isinstance(body, Prompts) and client.rejected == 1
    client.close()
    server.close()
