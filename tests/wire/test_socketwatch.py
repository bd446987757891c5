import subprocess
import sys

import zmq

from asyncrl.wire.socketwatch import CUT_WINDOW_S, _Watched

OK, GONE = zmq.Event.HANDSHAKE_SUCCEEDED, zmq.Event.DISCONNECTED


def watched(curve=False, cuts=True):
    seen = []
    return _Watched("test.watched", curve, cuts, lambda reason, detail: seen.append(reason)), seen


def test_a_cut_connection_that_comes_back_at_once_is_counted_as_oversized():
    w, seen = watched()
    for event, t in ((OK, 0.0), (GONE, 10.0), (OK, 10.0 + CUT_WINDOW_S / 2)):
        w.handle(event, t)
    assert seen == ["oversized"]


def test_a_peer_that_leaves_is_not_counted_even_if_another_joins_later():
    w, seen = watched()
    for event, t in ((OK, 0.0), (GONE, 10.0), (OK, 10.0 + 2 * CUT_WINDOW_S), (OK, 11.0 + 2 * CUT_WINDOW_S)):
        w.handle(event, t)
    assert seen == []


def test_a_refused_handshake_is_not_mistaken_for_a_cut():
    w, seen = watched()
    for event, t in ((zmq.Event.HANDSHAKE_FAILED_PROTOCOL, 1.0), (GONE, 1.0), (OK, 1.1)):
        w.handle(event, t)
    assert seen == ["bad_handshake"]  # a peer that does not speak ZMTP, on a plain socket


def test_a_socket_that_only_sends_counts_no_cuts():
    w, seen = watched(cuts=False)
    for event, t in ((OK, 0.0), (GONE, 1.0), (OK, 1.1)):
        w.handle(event, t)
    assert seen == []


RETRY = zmq.Event.CONNECT_RETRIED


def test_on_a_connecting_socket_a_drop_never_retried_is_counted_and_a_peer_that_left_is_not():
    w, seen = watched()
    w.connects = True
    for event, t in ((OK, 0.0), (GONE, 10.0), (RETRY, 10.1), (OK, 10.2)):  # the peer restarted
        w.handle(event, t)
    w.tick(20.0)
    assert seen == []
    w.handle(GONE, 30.0)  # libzmq refused a frame: no retry follows
    w.tick(30.0 + CUT_WINDOW_S / 2)
    assert seen == []
    w.tick(30.0 + 2 * CUT_WINDOW_S)
    assert seen == ["oversized"]


def test_a_process_that_destroys_its_context_ends_without_a_traceback_from_the_watcher():
    # Every process of a run ends by destroying its ZeroMQ context; the watcher thread then wakes
    # in ``poll`` to ContextTerminated, which must end it quietly rather than print a traceback
    # into every log.
    code = """
import time, zmq
from asyncrl.wire.socketwatch import watch
ctx = zmq.Context()
sock = ctx.socket(zmq.PULL)
sock.bind("tcp://127.0.0.1:0")
watch(sock, "pull", curve=False, cuts=False, on_reject=lambda reason, detail: None)
time.sleep(0.3)
ctx.destroy(linger=0)
time.sleep(0.6)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
