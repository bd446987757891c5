"""ZeroMQ senders and receivers: the only way asyncrl processes talk to each other.

Each class wraps one socket and states its blocking and dropping behaviour. All of them carry
one ``wire`` message per ZeroMQ frame, bind or connect on ``tcp://127.0.0.1:PORT`` (or ``ipc://``),
set ``LINGER`` so that ``close()`` never hangs, and take their security from ``asyncrl.wire.security``:
CURVE when the run asks for it, and on receiving sockets ``MAXMSGSIZE`` from
``security.max_message_bytes`` (per kind: ``stream``, ``request``, ``reply``, ``subscribe``), so
an oversized frame is refused by ZeroMQ from its length header, before it is buffered. ZeroMQ
does that by closing the connection (a ZeroMQ peer reconnects within 100 ms; frames behind the
big one on that connection are lost with it). On a socket that *connects* (SUB, DEALER, a
connected PULL) libzmq does not reconnect after such a refusal, so the receiver connects again
itself at its next receive: without that, one oversized frame would leave it deaf for good.

Receivers decode and validate: a frame that fails ``codec.decode`` (the same size limit is checked
again there) is counted in ``asyncrl_rejected_frames{socket,reason}``, logged once per reason, and
skipped; the receiver keeps serving. What libzmq refuses by itself (connections cut for size,
failed handshakes) is counted from the socket's monitor events (``asyncrl.wire.socketwatch``). Every
receive takes a timeout and returns ``None`` when it expires, so nothing waits forever.

| class | socket | send blocks | dropped |
| --- | --- | --- | --- |
| StreamSender / StreamReceiver | PUSH / PULL | while every peer is at its high-water mark, up to the timeout (then ``TimeoutError``) | nothing |
| Publisher / Subscriber | PUB / SUB | never | messages past a subscriber's HWM; all messages before a subscriber joins (so publishers repeat their latest state) |
| RequestClient / ReplyServer | DEALER / ROUTER | client: like PUSH; server reply: never | a reply to a peer that has gone or is at its HWM |
| EvalRequestSender / EvalRequestReceiver | PUSH / PULL (controller -> generators) | never: a request no generator can take now is kept and offered again | requests queued at a generator that dies (the sender's timeout sends them again) |
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from asyncrl.observability.metrics import REJECTED_FRAMES
from asyncrl.wire import codec, security, socketwatch
from asyncrl.wire.messages import EvalRequest, Exchange, Message
from asyncrl.wire.schema import WireError

log = logging.getLogger(__name__)

DEFAULT_HWM = 1000
ZERO_COPY_BYTES = 1 << 20  # frames at least this big are handed to ZeroMQ without a copy


class _Socket:
    def __init__(
        self,
        kind: int,
        address: str,
        bind: bool,
        name: str,
        hwm: int,
        limit: str | None,
        max_message_bytes: int | None = None,
    ):
        """``limit``: the kind of receiving socket whose ``security.max_message_bytes`` applies
        (None for sockets that only send); ``max_message_bytes`` overrides it."""
        if hwm < 1:
            raise ValueError(f"hwm ({hwm}) must be >= 1")
        if max_message_bytes is None and limit is not None:
            max_message_bytes = security.max_message_bytes(limit)
        self.name = name
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(kind)
        # ms a close() waits to flush queued frames, then drops them; senders wait longer
        # because their last frames (a generator's final groups) must not be lost on exit.
        self.sock.setsockopt(zmq.LINGER, 10_000 if kind in (zmq.PUSH, zmq.DEALER) else 1000)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        if kind in (zmq.PUSH, zmq.DEALER):
            # Queue only to connected peers: with no receiver a send waits (and times out)
            # instead of silently piling frames onto a connection that may never come up.
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        if max_message_bytes is not None:
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.max_message_bytes = max_message_bytes
        self._logged_reasons: set[str] = set()
        self.rejected = 0
        self._connects = not bind
        self._cut = False  # set by the socket watcher's thread: libzmq ended the connection for good
        self.curve = security.secure(self.sock, address, bind)
        self._watched = self.curve or max_message_bytes is not None
        if self._watched:  # before bind/connect, so that no handshake goes unseen
            socketwatch.watch(
                self.sock, name, self.curve, max_message_bytes is not None, self._reject, connects=not bind
            )
        if bind:
            self.sock.bind(address)
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.connect(address)
            self.address = address

    def _decode(self, frame: bytes) -> tuple[str, Message] | None:
        try:
            return codec.decode(frame, self.max_message_bytes)
        except WireError as e:
            self._reject(e.reason, str(e))
            return None

    def _reject(self, reason: str, detail: str) -> None:
        """Count a rejected frame; log the first of each reason (a flood must not flood the log).
        An oversized frame on a connecting socket ended its connection: ``_reconnect_if_cut``."""
        if reason == "oversized" and self._connects:
            self._cut = True
        self.rejected += 1
        REJECTED_FRAMES.labels(self.name, reason).inc()
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            if reason == "oversized":
                detail += f" (limit {self.max_message_bytes} bytes: security.max_message_bytes)"
            log.warning("%s: rejected a frame (%s); further %r rejections are only counted", self.name, detail, reason)

    def _reconnect_if_cut(self) -> None:
        """Connect again after libzmq refused a frame and dropped the connection (see the module
        docstring); the frames queued behind the refused one on that connection are gone."""
        if self._cut:
            self._cut = False
            self.sock.disconnect(self.address)
            self.sock.connect(self.address)
            log.info("%s: connected again to %s after a refused frame", self.name, self.address)

    def _recv_valid(self, timeout: float) -> tuple[str, Message] | None:
        """The next frame that decodes, skipping (and counting) the ones that do not, or None
        once ``timeout`` seconds pass."""
        self._reconnect_if_cut()
        try:  # a frame already queued needs no poll (a system call per message at full rate)
            msg = self._decode(self.sock.recv(zmq.NOBLOCK))
            if msg is not None:
                return msg
        except zmq.Again:
            pass
        deadline = time.monotonic() + timeout
        while self._poll_in(deadline - time.monotonic()):
            msg = self._decode(self.sock.recv())
            if msg is not None:
                return msg
        return None

    def _poll_in(self, timeout: float) -> bool:
        return bool(self.sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN))

    def close(self) -> None:
        if self._watched:
            socketwatch.unwatch(self.sock)
        self.sock.close()


class StreamSender(_Socket):
    """PUSH: round-robins messages over connected receivers; ``send`` blocks while all are full."""

    def __init__(self, address: str, name: str, bind: bool = False, hwm: int = DEFAULT_HWM):
        super().__init__(zmq.PUSH, address, bind, name, hwm, None)

    def send(self, message: Message, timeout: float = 30.0) -> None:
        self.send_frame(codec.encode(message), timeout)

    def send_frame(self, frame: bytes, timeout: float = 30.0) -> None:
        """Raise ``TimeoutError`` if no receiver takes the frame within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                # Zero-copy pays for its bookkeeping (a message to the collector thread per
                # frame) only on big frames; a 64 KiB group is cheaper copied.
                self.sock.send(frame, zmq.NOBLOCK, copy=len(frame) < ZERO_COPY_BYTES)
                return
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no receiver took a frame within {timeout} s") from None
                self.sock.poll(int(min(left, 0.1) * 1000), zmq.POLLOUT)

    def send_until_taken(self, frame: bytes, warn_every: float = 30.0) -> None:
        """Send, waiting as long as backpressure lasts; log every ``warn_every`` s what waits."""
        while True:
            try:
                self.send_frame(frame, timeout=warn_every)
                return
            except TimeoutError:
                log.warning("%s: no receiver took a frame for %.0f s; still waiting", self.name, warn_every)


class StreamReceiver(_Socket):
    """PULL: fair-queues frames from all senders; frames over ``max_message_bytes`` are refused."""

    def __init__(
        self,
        address: str,
        name: str,
        bind: bool = True,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int | None = None,
    ):
        super().__init__(zmq.PULL, address, bind, name, hwm, "stream", max_message_bytes)

    def recv(self, timeout: float) -> tuple[str, Message] | None:
        """The next valid message, or None when none arrives within ``timeout`` seconds."""
        return self._recv_valid(timeout)


class Publisher(_Socket):
    """PUB: fan-out to every subscriber; never blocks; slow or late subscribers miss messages."""

    def __init__(self, address: str, name: str, bind: bool = True, hwm: int = 100):
        super().__init__(zmq.PUB, address, bind, name, hwm, None)

    def send(self, message: Message) -> None:
        self.sock.send(codec.encode(message), copy=False)


class Subscriber(_Socket):
    """SUB to every message of a publisher (no topic filtering: messages are small and few)."""

    def __init__(self, address: str, name: str, hwm: int = 100, max_message_bytes: int | None = None):
        super().__init__(zmq.SUB, address, False, name, hwm, "subscribe", max_message_bytes)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")

    def recv(self, timeout: float) -> tuple[str, Message] | None:
        return self._recv_valid(timeout)

    def recv_latest(self) -> list[tuple[str, Message]]:
        """Every message already queued, without waiting (for polling loops)."""
        out = []
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out


class RequestClient(_Socket):
    """DEALER: send a request, wait for a reply with a timeout.

    Unlike REQ it never gets stuck in a send/recv state after a lost reply. A reply that arrives
    after its request timed out is *not* dropped: the next ``request`` returns it (its
    ``request_id`` says which request it answers), because replies carry work — prompts, a
    batch — that would otherwise be lost between two processes.
    """

    def __init__(self, address: str, name: str, hwm: int = DEFAULT_HWM, max_message_bytes: int | None = None):
        super().__init__(zmq.DEALER, address, False, name, hwm, "reply", max_message_bytes)
        self._next_id = 0

    def request(self, message: Exchange, timeout: float) -> tuple[str, Message] | None:
        """Send and return the first reply that arrives (possibly to an earlier request), or None
        if none arrives within ``timeout`` seconds."""
        self._next_id += 1
        frame = codec.encode(msgspec.structs.replace(message, request_id=self._next_id))
        self._reconnect_if_cut()
        if not self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
            return None
        self.sock.send(frame, copy=False)
        return self._recv_valid(timeout)

    def receive(self, timeout: float) -> tuple[str, Message] | None:
        """A reply still on its way (to a request that timed out), without asking again."""
        return self._recv_valid(timeout)


class ReplyServer(_Socket):
    """ROUTER: receive requests from many clients, reply to each by its identity."""

    def __init__(
        self,
        address: str,
        name: str,
        bind: bool = True,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int | None = None,
    ):
        super().__init__(zmq.ROUTER, address, bind, name, hwm, "request", max_message_bytes)

    def recv(self, timeout: float) -> tuple[bytes, str, Message] | None:
        """(client identity, kind, body) of the next valid request, or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._poll_in(deadline - time.monotonic()):
            parts = self.sock.recv_multipart()
            if len(parts) != 2:
                self._decode(b"")  # counted as malformed
                continue
            msg = self._decode(parts[1])
            if msg is not None:
                return parts[0], msg[0], msg[1]
        return None

    def reply(self, client: bytes, message: Exchange, request_id: int | None) -> None:
        frame = codec.encode(msgspec.structs.replace(message, request_id=request_id))
        self.sock.send_multipart([client, frame], copy=False)


def tcp_address(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def flush_on_exit(timeout: float = 10.0) -> None:
    """Let libzmq send what closed sockets still queue (a last reply, a final report) before the
    process exits: exiting without terminating the context drops it. ``term`` waits for every
    socket to close, so it runs on a side thread that is given up after ``timeout`` seconds."""
    import threading

    done = threading.Thread(target=zmq.Context.instance().term, daemon=True, name="zmq-flush")
    done.start()
    done.join(timeout)


class EvalRequestSender:
    """The controller's end of held-out evaluation: ``eval_request`` messages to the generators.

    PUSH, bound by the controller: ZeroMQ deals requests round-robin over the generators that
    are connected and below their high-water mark, so the work spreads without a scheduler.
    ``offer`` never blocks: with no generator connected or every one full it returns False and
    the caller keeps the request. A request queued at a generator that then dies is lost with
    it; the caller's per-request timeout (``asyncrl.tasks.heldout``) sends it again. The high-water
    mark is small (a few requests per generator) so that requests do not pile up at one
    generator while another is idle.
    """

    def __init__(self, address: str, name: str = "controller.evals", hwm: int = 2):
        self.stream = StreamSender(address, name=name, bind=True, hwm=hwm)
        self.address = self.stream.address

    def offer(self, request: EvalRequest) -> bool:
        """Queue one request for some generator; False when none can take it now."""
        try:
            self.stream.send(request, timeout=0)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.stream.close()


class EvalRequestReceiver:
    """A generator's end of held-out evaluation: takes at most one ``eval_request`` at a time.

    PULL, connected to the controller's PUSH, with a high-water mark of 1 so that a busy
    generator holds little and the controller's round-robin passes over it. ``take`` never
    blocks: the generator asks between two training batches, which is how evaluation
    interleaves with training without starving either (one request per turn at most). A frame
    that fails validation is counted and skipped (``asyncrl_rejected_frames``).
    """

    def __init__(self, address: str, name: str):
        self.stream = StreamReceiver(address, name=name, bind=False, hwm=1)

    def take(self) -> EvalRequest | None:
        """The next request already here, or None (a frame of another kind is skipped)."""
        msg = self.stream.recv(timeout=0)
        return msg[1] if msg is not None and isinstance(msg[1], EvalRequest) else None

    def close(self) -> None:
        self.stream.close()
