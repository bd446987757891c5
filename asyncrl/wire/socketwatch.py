"""Counting what libzmq refuses without telling the application: failed handshakes and frames
over ``MAXMSGSIZE``. One daemon thread per process reads the monitor events of the sockets
registered with ``watch``.

- A failed handshake (``HANDSHAKE_FAILED_*``: a client without a CURVE key, with a key the
  authenticator does not admit, with a wrong server key, or not speaking ZMTP at all) is
  counted in ``asyncrl_auth_failures_total{socket}`` on a CURVE socket, and as a rejected frame
  with reason ``bad_handshake`` on any other; logged once per socket.
- A frame over ``MAXMSGSIZE``: libzmq closes the connection, and its monitor reports that with
  exactly the events of a peer that closed (``DISCONNECTED`` after a successful handshake; no
  reason is given — checked against libzmq 4.3.5). What tells them apart is what follows: a
  ZeroMQ peer that was cut off reconnects by itself within ``RECONNECT_IVL`` (100 ms), a peer
  that left does not. So a disconnect followed within ``CUT_WINDOW_S`` by a new successful
  handshake on the same socket is counted as a rejected frame with reason ``oversized``. This
  miscounts a peer that leaves while another joins within that window (peers restart in
  seconds, not milliseconds), and a non-ZeroMQ sender that does not reconnect is not counted:
  its frame is refused all the same. The decode-time check in ``asyncrl.wire.schema`` counts exactly.
- On a socket that *connects* (a SUB, a DEALER) the same refusal looks different: libzmq treats
  it as a protocol error and ends that connection for good, without reconnecting (checked
  against libzmq 4.3.5), whereas a peer that left is retried within ``RECONNECT_IVL``
  (``CONNECT_RETRIED``, ``CONNECT_DELAYED``). So there a disconnect followed by no attempt to
  connect again within ``CUT_WINDOW_S`` is counted as ``oversized``, and the owner, told through
  ``on_reject``, must connect again itself (the weight stream's subscriber does).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import zmq
from prometheus_client import Counter
from zmq.utils.monitor import parse_monitor_message

from asyncrl.observability.metrics import REGISTRY

log = logging.getLogger(__name__)

AUTH_FAILURES = Counter(
    "asyncrl_auth_failures",
    "Connections refused at the handshake on a CURVE socket (no key, unknown key, wrong server key).",
    ["socket"],
    registry=REGISTRY,
)

CUT_WINDOW_S = 0.5
_HANDSHAKE_FAILED = (
    zmq.Event.HANDSHAKE_FAILED_NO_DETAIL | zmq.Event.HANDSHAKE_FAILED_PROTOCOL | (zmq.Event.HANDSHAKE_FAILED_AUTH)
)
_RETRIES = zmq.Event.CONNECT_RETRIED | zmq.Event.CONNECT_DELAYED | zmq.Event.CONNECTED
_EVENTS = _HANDSHAKE_FAILED | zmq.Event.HANDSHAKE_SUCCEEDED | zmq.Event.DISCONNECTED | _RETRIES


class _Watched:
    """Event state of one socket: handshake failures still to be matched with their disconnect,
    and recent disconnects of established connections."""

    def __init__(
        self, name: str, curve: bool, cuts: bool, on_reject: Callable[[str, str], None], connects: bool = False
    ):
        self.name = name
        self.connects = connects
        self.curve = curve
        self.count_cuts = cuts
        self.on_reject = on_reject
        self.failed_pending = 0
        self.cuts: collections.deque[float] = collections.deque()
        self.logged_auth = False

    def handle(self, event: int, now: float) -> None:
        if event & _HANDSHAKE_FAILED:
            self.failed_pending += 1
            if self.curve:
                AUTH_FAILURES.labels(self.name).inc()
                if not self.logged_auth:
                    self.logged_auth = True
                    log.warning(
                        "%s: refused a connection that failed the CURVE handshake (%s); further ones are only counted",
                        self.name,
                        zmq.Event(event).name,
                    )
            else:
                self.on_reject(
                    "bad_handshake", f"bad_handshake: a peer failed the ZeroMQ handshake ({zmq.Event(event).name})"
                )
        elif event == zmq.Event.DISCONNECTED:
            if self.failed_pending:  # the end of a refused handshake, already counted
                self.failed_pending -= 1
            elif self.count_cuts:
                self.cuts.append(now)
        elif event & _RETRIES:
            if self.connects:  # libzmq connects again: the peer left, nothing was refused
                self.cuts.clear()
        elif event == zmq.Event.HANDSHAKE_SUCCEEDED and not self.connects:
            while self.cuts and now - self.cuts[0] > CUT_WINDOW_S:
                self.cuts.popleft()  # a peer that left
            if self.cuts:
                self.cuts.popleft()
                self.on_reject("oversized", "oversized: ZeroMQ cut a connection over a frame larger than MAXMSGSIZE")

    def tick(self, now: float) -> None:
        """On a connecting socket: a disconnect that no attempt to connect again followed within
        ``CUT_WINDOW_S`` was libzmq refusing a frame (see the module docstring)."""
        while self.connects and self.cuts and now - self.cuts[0] > CUT_WINDOW_S:
            self.cuts.popleft()
            self.on_reject(
                "oversized",
                "oversized: ZeroMQ dropped the connection over a frame larger than MAXMSGSIZE and will not reconnect it",
            )


class _Watcher:
    def __init__(self):
        self._lock = threading.Lock()
        self._new: list[tuple[zmq.Socket, _Watched]] = []
        self._thread: threading.Thread | None = None

    def add(self, monitor: zmq.Socket, watched: _Watched) -> None:
        with self._lock:  # the lock also hands the monitor socket over to the thread safely
            self._new.append((monitor, watched))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="asyncrl-socketwatch", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._watch()
        except zmq.ZMQError as error:
            # The process is shutting ZeroMQ down: the context is terminated, or destroyed with
            # the monitor sockets closed under this thread. Nothing is left to watch.
            if not isinstance(error, zmq.ContextTerminated) and error.errno != zmq.ENOTSOCK:
                raise

    def _watch(self) -> None:
        poller = zmq.Poller()
        watched: dict[zmq.Socket, _Watched] = {}
        while True:
            with self._lock:
                for monitor, w in self._new:
                    poller.register(monitor, zmq.POLLIN)
                    watched[monitor] = w
                self._new.clear()
            # Short timeout: sockets registered meanwhile are picked up within 0.25 s; their
            # events wait in their monitor queue until then.
            for monitor, _ in poller.poll(250):
                msg = parse_monitor_message(monitor.recv_multipart())
                if msg["event"] == zmq.Event.MONITOR_STOPPED:  # the socket is closing
                    poller.unregister(monitor)
                    del watched[monitor]
                    monitor.close(linger=0)
                    continue
                watched[monitor].handle(msg["event"], time.monotonic())
            now = time.monotonic()
            for w in watched.values():
                w.tick(now)


_watcher = _Watcher()


def watch(
    sock: zmq.Socket,
    name: str,
    curve: bool,
    cuts: bool,
    on_reject: Callable[[str, str], None],
    connects: bool = False,
) -> None:
    """Follow ``sock``'s handshakes, and with ``cuts`` (a receiving socket with ``MAXMSGSIZE``)
    its connections cut for size (``connects``: the socket connects rather than binds);
    ``on_reject(reason, detail)`` is called (from the watcher thread) for what counts as a
    rejected frame. Call ``unwatch`` before closing the socket.

    A DEALER/ROUTER pair receives on both ends, so a cut is counted at both: neither end can tell
    which of them refused the frame."""
    monitor = sock.get_monitor_socket(_EVENTS)
    _watcher.add(monitor, _Watched(name, curve, cuts, on_reject, connects))


def unwatch(sock: zmq.Socket) -> None:
    try:
        sock.disable_monitor()
    except zmq.ZMQError:  # never monitored, or already closed
        pass
