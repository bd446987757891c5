"""Weight broadcast as a ZeroMQ stream of ~1 MiB frames, to any number of subscribers on any host.

One PUB socket carries, per version: a ``weights_begin`` message, then the learner's buckets
cut at tensor boundaries into multipart messages of at most ``MESSAGE_BYTES`` (8 MiB) — a header
frame ``{policy_version, index, crc, hash, nbytes, tensors}`` followed by each tensor's bytes cut
into ``frame_bytes`` slices (a frame never spans two tensors) sent with ``copy=False`` — then
``weights_end {num_buckets, bytes}``. Each subscriber checks the order, every message's
checksum, and the count at the end. Below, a *bucket* is one such message: the index, the
checksum and the receive buffer are its own.

Copies: none on the learner when a bucket's tensors are on the CPU, contiguous and stay put
until the next bucket is asked for (a plain model, a state dict): the frames are views of the
tensors and libzmq fans the same memory out to every subscriber. A bucket on the GPU, or
gathered under ZeRO-3 (``Bucket.transient``: freed at the next ``next()``), is packed once into
a host buffer. A subscriber takes each frame out of libzmq without a copy (``copy=False``) and,
in one pass, adds it to the checksum and copies it to its place in the bucket's buffer
(``Digest.copy``: each word read once, where libzmq put it, still in cache, and written past
the cache to the buffer, ``asyncrl.weights.fletcher``). Every frame is copied, even one that
holds a whole tensor: libzmq then gets its memory back at once, for the next frame, still in cache,
where a frame kept as its tensor holds its memory until the version is done, and libzmq takes
fresh pages for the frames after it (1 GB to one subscriber took ~0.35 s with such frames kept,
~0.24 s with every frame copied). The checksum is over the tensors' bytes
in order (padding excluded), taken frame by frame (``Digest``): ``fletcher64`` (the default:
order-sensitive, and fused with the copy), ``sum64`` and ``xxh3`` or ``crc32`` (a sum, then a
copy). Each tensor, and each frame within it, starts 8-aligned, so the word sums see the same
words whether a tensor is summed whole (the learner) or frame by frame (a subscriber).

Memory: frames that are views of the model's own tensors cost nothing while queued, so up to
``WINDOW`` such buckets go out back to back (libzmq always has the next one when a bucket has
left; the publisher checksums bucket i while bucket i-1 is on the wire). A bucket packed into a
buffer waits until the bucket before it has left for every subscriber (its last frame tracked
with ``track=True``), so at most two packing buffers exist (``buffer_bytes``/``peak_buffer_bytes``
count them: tracemalloc does not see torch memory). Packing buffers whose frames have left are reused,
as are a subscriber's receive buffers once the update holding them is ``done()`` (warm memory:
no page faults on the next version), which is why its tensors are valid only until then. A
subscriber that dies mid-broadcast drops its connection, and with it its queue: the others are
not held up. A live subscriber that stops reading holds the wait up to ``send_timeout_s``; the
publisher then logs it, counts a failure and moves on (the bucket stays queued for that
subscriber, at most ``SNDHWM`` buckets).

| socket | blocks | dropped |
| --- | --- | --- |
| PUB (learner) | never on send; ``publish`` waits up to ``send_timeout_s`` per bucket for the slowest live subscriber | messages past SNDHWM (16 messages) for a subscriber that has stopped reading; everything before a subscriber joins |
| SUB (generator) | ``newest`` waits up to ``timeout_s`` for each next message once a version has begun (``TimeoutError`` naming it) | nothing: RCVHWM is unlimited, so a generator busy sampling queues versions in its own memory |

What libzmq refuses without telling either end is counted as on the run's other sockets
(``asyncrl.wire.socketwatch``): a failed CURVE handshake on either end in
``asyncrl_auth_failures_total{socket}``, and a frame over the subscriber's ``MAXMSGSIZE`` in
``asyncrl_rejected_frames_total{socket, reason="oversized"}`` (``rejected`` on the object);
libzmq then drops the subscriber's connection for good, so it connects again at its next ``newest``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

import torch
import zmq

from asyncrl import wire
from asyncrl.observability.metrics import REJECTED_FRAMES, WEIGHT_FAILURES
from asyncrl.weights import fletcher
from asyncrl.weights.buckets import HASHES, Digest, layout, pack_into, specs_from_wire, specs_to_wire
from asyncrl.weights.update import WeightSyncError, WeightUpdate
from asyncrl.wire import security, socketwatch
from asyncrl.wire.messages import Message, WeightsBegin, WeightsBucket, WeightsEnd

log = logging.getLogger(__name__)

FRAME_BYTES = 1 << 20
MESSAGE_BYTES = 8 << 20
"""Most bytes of tensors in one bucket message: a learner's bucket (``weights.bucket_mb``, 64 MiB
by default) is cut at tensor boundaries into messages of at most this much (a larger tensor
goes alone). ZeroMQ hands a multipart message over only once all its frames are in, so with
whole 64 MiB buckets a subscriber could not start copying a bucket before its last frame, nor
the learner send one before summing all of it: at 100 MB that was ~half the time."""
WINDOW = 4
"""Buckets of tensor views queued at once (plus a version's begin and end: within SNDHWM, 16)."""


class ZmqWeightPublisher:
    """Streams versions bucket by bucket on a PUB socket (see the module docstring)."""

    transport = "zmq"

    def __init__(
        self,
        address: str,
        name: str = "learner.weights.stream",
        frame_bytes: int = FRAME_BYTES,
        send_timeout_s: float = 60.0,
        hash: str = "fletcher64",
        message_bytes: int = MESSAGE_BYTES,
    ):
        if frame_bytes < 64:
            raise ValueError(f"frame_bytes ({frame_bytes}) must be >= 64")
        if send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s ({send_timeout_s}) must be > 0")
        if hash not in HASHES:
            raise ValueError(f"hash ({hash!r}) must be one of {HASHES}")
        if hash == "fletcher64":
            fletcher.warm()
        self.name = name
        self.hash = hash
        self.frame_bytes = frame_bytes // 64 * 64  # whole cache lines
        if message_bytes < self.frame_bytes:
            raise ValueError(f"message_bytes ({message_bytes}) must be >= frame_bytes ({self.frame_bytes})")
        self.message_bytes = message_bytes
        self.send_timeout_s = send_timeout_s
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 16)
        self.rejected = 0
        self._watched = security.secure(self.sock, address, bind=True)  # CURVE server when the run asks for it
        if self._watched:  # before bind, so that no handshake goes unseen
            socketwatch.watch(self.sock, name, True, False, self._reject)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stalled = 0  # buckets some live subscriber had not taken within send_timeout_s
        self._spare: list[torch.Tensor] = []  # packing buffers whose frames have left: reused, warm
        self.buffer_bytes = 0
        """Bytes of packing buffers alive now (in flight or spare): the learner's extra memory."""
        self.peak_buffer_bytes = 0
        """Most ``buffer_bytes`` seen during the last ``publish``."""

    def publish(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, meta: dict | None = None
    ) -> dict:
        """Stream every bucket (consumed one at a time, each as one or more messages of at most
        ``message_bytes``); returns {bytes, buckets (messages sent), seconds, extra_bytes}."""
        start = time.perf_counter()
        self.peak_buffer_bytes = self.buffer_bytes
        self.sock.send(wire.encode(WeightsBegin.from_map({"policy_version": version, **(meta or {})})))
        in_flight: deque[tuple[int, list[zmq.MessageTracker], torch.Tensor | None, list]] = deque()
        total = index = 0
        for named in _messages(buckets, self.message_bytes):
            specs, size = layout(named)
            if named.zero_copy:
                buf, views = None, [_flat(t) for _, t in named]
            else:  # on a GPU, or freed at the next bucket (ZeRO-3): packed once into host memory
                while len(in_flight) > 1:  # one bucket in flight while packing: two buffers at most
                    self._finish(version, in_flight.popleft())
                buf = self._buffer(max(size, 1))  # not the one in flight
                pack_into(named, specs, buf[: max(size, 1)], None)  # summed below, as the views are
                views = [buf[sp.offset : sp.offset + sp.nbytes] for sp in specs]
            crc = tensors_checksum(views, self.hash)
            # Views of the model's own tensors cost no memory while queued: up to WINDOW buckets
            # go out back to back, so libzmq always has the next one when a bucket has left. A
            # packing buffer waits for the bucket before it (two buffers at most).
            views_only = buf is None and all(item[2] is None for item in in_flight)
            while len(in_flight) >= (WINDOW if views_only else 1):
                self._finish(version, in_flight.popleft())
            header = wire.encode(
                WeightsBucket(
                    policy_version=version,
                    index=index,
                    crc=crc,
                    hash=self.hash,
                    nbytes=max(size, 1),
                    tensors=specs_to_wire(specs),
                )
            )
            parts = [
                mv[o : o + self.frame_bytes]
                for mv in (memoryview(v.numpy()) for v in views)
                for o in range(0, len(mv), self.frame_bytes)
            ]
            self.sock.send(header, zmq.SNDMORE if parts else 0)
            for part in parts[:-1]:
                self.sock.send(part, zmq.SNDMORE, copy=False)
            # Only the last frame is tracked: each subscriber's pipe writes a message's frames in
            # order, so once the last has left for every one, all have (pyzmq holds each frame's
            # memory until libzmq lets it go, tracked or not).
            trackers = [self.sock.send(parts[-1], 0, copy=False, track=True)] if parts else []
            in_flight.append((index, trackers, buf, views))
            total += max(size, 1)
            index += 1
        while in_flight:
            self._finish(version, in_flight.popleft())
        self.sock.send(wire.encode(WeightsEnd(policy_version=version, num_buckets=index, bytes=total)))
        return {
            "bytes": total,
            "buckets": index,
            "seconds": time.perf_counter() - start,
            "extra_bytes": self.peak_buffer_bytes,
        }

    def _finish(self, version: int, in_flight: tuple) -> None:
        """Wait for a bucket's frames to leave; keep its packing buffer (if any) for reuse."""
        index, trackers, buf, _views = in_flight
        if self._wait_sent(version, index, trackers) and buf is not None:
            self._spare.append(buf)
        elif buf is not None:  # still referenced by frames queued for a stalled subscriber
            self.buffer_bytes -= buf.numel()
        while len(self._spare) > 2:
            self.buffer_bytes -= self._spare.pop(0).numel()

    def _buffer(self, size: int) -> torch.Tensor:
        """A packing buffer of at least ``size`` bytes, a spare one when one is big enough."""
        for i, spare in enumerate(self._spare):
            if spare.numel() >= size:
                return self._spare.pop(i)
        buf = torch.empty(size, dtype=torch.uint8)
        self.buffer_bytes += size
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        return buf

    def _wait_sent(self, version: int, index: int, trackers: list) -> bool:
        """Wait until a bucket's frames have left for every subscriber; False past the timeout."""
        deadline = time.monotonic() + self.send_timeout_s
        pending = [t for t in trackers if not t.done]
        while pending:
            try:
                pending[-1].wait(0.005)
            except zmq.NotDone:
                pass
            # libzmq handles a dead subscriber's disconnect (dropping its queue, which releases
            # our frames) only when this thread calls into the socket: poke it while waiting.
            self.sock.getsockopt(zmq.EVENTS)
            pending = [t for t in pending if not t.done]
            if pending and time.monotonic() > deadline:
                self.stalled += 1
                WEIGHT_FAILURES.labels("send").inc()
                log.error(
                    "%s: version %d bucket %d had not left for every subscriber after %.0f s (a subscriber stopped reading); moving on",
                    self.name,
                    version,
                    index,
                    self.send_timeout_s,
                )
                return False
        return True

    def announce(self, force: bool = False) -> None:
        """Nothing to repeat: a subscriber that joined late takes the next version."""

    def poll(self) -> None:
        pass

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected += 1
        REJECTED_FRAMES.labels(self.name, reason).inc()

    def close(self) -> None:
        if self._watched:
            socketwatch.unwatch(self.sock)
        self.sock.close()


class _Message(list):
    """The tensors of one bucket message, and whether its frames may be views of them."""

    def __init__(self, zero_copy: bool):
        super().__init__()
        self.zero_copy = zero_copy


def _messages(buckets: Iterable[list[tuple[str, torch.Tensor]]], cap: int) -> Iterable[_Message]:
    """Each bucket cut at tensor boundaries into runs of at most ``cap`` bytes (a larger tensor
    alone), in order; all of a bucket's messages are sent before the next bucket is asked for
    (a ZeRO-3 gather lives until then)."""
    for named in buckets:
        zero_copy = _zero_copy(named)
        message, size = _Message(zero_copy), 0
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            if message and size + nbytes > cap:
                yield message
                message, size = _Message(zero_copy), 0
            message.append((name, t))
            size += nbytes
        if message or not named:
            yield message


def _zero_copy(named) -> bool:
    """Frames can be views of the tensors themselves: on the CPU, contiguous, and alive until
    the next bucket is asked for (not a ZeRO-3 gather, which ``iter_buckets`` marks transient)."""
    if getattr(named, "transient", False):
        return False
    return all(t.device.type == "cpu" and t.is_contiguous() for _, t in named)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def tensors_checksum(views, algo: str = "fletcher64") -> int:
    """The bucket checksum of the stream: over each tensor's bytes in order (see the module docstring)."""
    digest = Digest(algo)
    for v in views:
        digest.update(v.numpy())
    return digest.value()


def _as_tensor(raw: torch.Tensor | None, spec) -> torch.Tensor:
    """A tensor of ``spec``'s dtype and shape over its bytes (``raw``: uint8; None: no bytes)."""
    dtype = getattr(torch, spec.dtype)
    if raw is None or spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return raw.view(dtype).view(spec.shape)


class ZmqWeightSubscriber:
    """Receives streamed versions; ``newest`` returns the newest complete, verified one."""

    transport = "zmq"

    def __init__(self, address: str, name: str = "generator.weights.stream", timeout_s: float = 60.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Each ~1 MiB frame is checked on its own (the limit is per frame, not per bucket).
        self.sock.setsockopt(zmq.MAXMSGSIZE, security.max_message_bytes("subscribe"))
        self.rejected = 0
        """Frames refused for size (each cuts the connection: libzmq then reconnects)."""
        curve = security.secure(self.sock, address, bind=False)
        self._cut = False  # set by the socket watcher's thread: libzmq dropped the connection
        socketwatch.watch(self.sock, name, curve, True, self._reject, connects=True)  # before connect: nothing unseen
        self.sock.connect(address)
        self._spare: list[bytearray] = []  # receive buffers of versions applied: reused, warm
        fletcher.warm()  # compiled now, not on the first version's first frame

    def _recv_header(self, timeout: float, what: str) -> tuple[str, Message]:
        """The first frame of the next message (its other frames stay queued: ``RCVMORE``)."""
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"{self.name}: waited {timeout:.1f} s for {what} from {self.address}")
        return wire.decode(self.sock.recv())

    def _drain(self) -> None:
        """Skip what is left of the current message (its parts have all arrived: ZeroMQ delivers a
        multipart message whole or not at all)."""
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv(copy=False)

    def newest(self, served_version: int, timeout: float = 0.0) -> WeightUpdate | None:
        """Take every message queued (waiting up to ``timeout`` s for the first); once a version
        has begun, wait up to ``timeout_s`` for each of its next messages. Returns the newest
        complete version above ``served_version``, or None."""
        if self._cut:  # libzmq will not reconnect after refusing a frame: deaf until we do
            self._cut = False
            self.sock.disconnect(self.address)
            self.sock.connect(self.address)
        best = None
        wait = timeout
        while self.sock.poll(int(wait * 1000), zmq.POLLIN):
            wait = 0
            kind, body = wire.decode(self.sock.recv())
            self._drain()
            if kind != "weights_begin":
                continue  # the tail of a version that began before we joined
            update = self._receive_version(body)
            if update.version > served_version and (best is None or update.version > best.version):
                if best is not None:
                    best.done()
                best = update
            else:
                update.done()
        return best

    def _receive_version(self, begin: WeightsBegin) -> WeightUpdate:
        start = time.perf_counter()
        version = begin.policy_version
        tensors, total, index = [], 0, 0
        buffers: list[bytearray] = []
        while True:
            kind, body = self._recv_header(self.timeout_s, f"bucket {index} (or the end) of version {version}")
            # another kind may carry no version at all
            sent_version = getattr(body, "policy_version", None)
            if sent_version != version or kind not in ("weights_bucket", "weights_end"):
                self._drain()
                raise WeightSyncError(f"{self.name}: version {version} interrupted by {kind} of version {sent_version}")
            if kind == "weights_end":
                if body.num_buckets != index:
                    raise WeightSyncError(
                        f"{self.name}: version {version} ended after {index} buckets, the learner sent {body.num_buckets}"
                    )
                meta = {k: v for k, v in begin.as_dict().items() if k != "policy_version"}
                update = WeightUpdate(version, tensors, meta, total, time.perf_counter() - start)
                # The newest version's buffers are kept for the next one (same sizes); older ones go.
                update._on_done = lambda error: setattr(self, "_spare", buffers)
                return update
            if body.index != index:
                self._drain()
                raise WeightSyncError(
                    f"{self.name}: version {version}: got bucket {body.index}, expected {index} (frames were dropped)"
                )
            what = f"{self.name}: version {version} bucket {index}"
            data = self._recv_buffer(body.nbytes)
            buffers.append(data)
            specs = specs_from_wire(body.tensors)
            tensors.extend(self._receive_bucket(data, specs, body.crc, body.hash, what))
            total += len(data)
            index += 1

    def _receive_bucket(self, data: bytearray, specs, crc: int, algo: str, what: str) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors, views of ``data``: each frame, taken out of libzmq without a copy
        (``copy=False``), is added to the checksum and copied into its tensor's place in one pass;
        raise on any mismatch."""
        if algo not in HASHES:
            self._drain()
            raise WeightSyncError(f"{what}: checksum {algo!r} is none of {HASHES}")
        view, flat = memoryview(data), torch.frombuffer(data, dtype=torch.uint8) if data else None
        digest = Digest(algo)
        tensors = []
        try:
            for spec in specs:
                offset, end = spec.offset, spec.offset + spec.nbytes
                if end > len(view):
                    raise WeightSyncError(
                        f"{what}: tensor {spec.name} ends at byte {end}, past the bucket's {len(view)}"
                    )
                while offset < end:
                    if not self.sock.getsockopt(zmq.RCVMORE):
                        raise WeightSyncError(
                            f"{what}: tensor {spec.name} got {offset - spec.offset} of {spec.nbytes} bytes (frames were lost)"
                        )
                    frame = self.sock.recv(copy=False).buffer
                    n = len(frame)
                    if n > end - offset:
                        raise WeightSyncError(f"{what}: a frame of {n} bytes overruns tensor {spec.name}")
                    digest.copy(frame, view[offset : offset + n])
                    offset += n
                tensors.append((spec.name, _as_tensor(flat[spec.offset : end] if flat is not None else None, spec)))
            if self.sock.getsockopt(zmq.RCVMORE):
                raise WeightSyncError(f"{what}: more bytes than its tensors hold")
        finally:
            self._drain()
        got = digest.value()
        if got != crc:
            raise WeightSyncError(
                f"{what}: {algo} checksum mismatch (got {got:#x}, expected {crc:#x}): corrupted in transit"
            )
        return tensors

    def _recv_buffer(self, size: int) -> bytearray:
        for i, spare in enumerate(self._spare):
            if len(spare) == size:
                return self._spare.pop(i)
        return bytearray(size)

    def _reject(self, reason: str, detail: str) -> None:
        """Count a frame refused (``socketwatch`` calls it from its thread); an oversized one ended
        the connection for good, so ``newest`` connects again."""
        self._cut = self._cut or reason == "oversized"
        self.rejected += 1
        REJECTED_FRAMES.labels(self.name, reason).inc()
        if self.rejected == 1:  # a flood must not flood the log
            log.warning(
                "%s: refused a frame from %s (%s); further ones are only counted", self.name, self.address, detail
            )

    def close(self) -> None:
        socketwatch.unwatch(self.sock)
        self.sock.close()
