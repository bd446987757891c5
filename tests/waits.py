"""Bounded waits for tests: poll for what a test waits for, never sleep and hope.

Each wait names what it waits for and fails with that name at its bound. The bounds are
generous (``WAIT_S``): a machine running several test suites at once can stall a process for
seconds, and a bound is there to turn a hang into a failure, not to measure speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import zmq

from asyncrl import wire

T = TypeVar("T")

WAIT_S = 30.0


def wait_until(
    check: Callable[[], T], what: str, timeout: float = WAIT_S, interval: float = 0.01, tick: Callable | None = None
) -> T:
    """Poll ``check()`` until it is truthy and return it; ``tick()`` (if given) runs between polls
    (e.g. a publisher's ``announce``). Fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        if tick is not None:
            tick()
        time.sleep(interval)
    return result


def has_message(sock: zmq.Socket) -> bool:
    """A message is queued on ``sock`` (it stays there)."""
    return bool(sock.poll(0, zmq.POLLIN))


def wait_subscribed(send_probe: Callable[[], None], subscribed: Callable[[], bool], what: str, timeout=WAIT_S) -> None:
    """Send a probe every 10 ms until ``subscribed()`` says each subscriber has one.

    A PUB socket drops what it sends before a subscriber's subscription has reached it (ZeroMQ's
    slow joiner), however long ago the subscriber connected; once one message has arrived, every
    later one does (in order). So instead of sleeping "long enough" after connecting, a test
    sends something its subscribers ignore (a repeat of a version they serve, the tail of a
    version they never began) until each has received it. The probes left queued are read and
    ignored by the subscribers as in a run."""
    wait_until(subscribed, what, timeout, tick=send_probe)


def receive_version(sub, pub=None, served: int = 0, timeout: float = WAIT_S):
    """A weight subscriber's next version above ``served``. ``pub`` (if given) repeats its
    announcement meanwhile, at most once a second as the learner's idle loop does, so that a
    subscriber that joined after the first announcement still hears it."""
    return wait_until(
        lambda: sub.newest(served, timeout=0.2),
        f"{sub.name} to receive a version above {served}",
        timeout,
        interval=0,
        tick=None if pub is None else pub.announce,
    )


# What a stream subscriber (``ZmqWeightSubscriber``) skips: the tail of a version begun before it joined.
STREAM_PROBE = wire.encode_map("weights_end", {"policy_version": 0, "num_buckets": 0, "bytes": 0})


def stream_subscribed(pub_sock: zmq.Socket, subs) -> None:
    """Probe a weight stream's PUB socket until every subscriber in ``subs`` has heard it."""
    wait_subscribed(
        lambda: pub_sock.send(STREAM_PROBE),
        lambda: all(has_message(sub.sock) for sub in subs),
        f"{[sub.name for sub in subs]} to be subscribed to {pub_sock.getsockopt_string(zmq.LAST_ENDPOINT)}",
    )
