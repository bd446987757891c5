"""Weight broadcast as a ZeroMQ stream of ~1 MiB frames, to any number of subscribers on any host.

One PUB socket carries, per version: a ``weights_begin`` message, then one multipart message
per bucket — a header frame ``{policy_version, index, crc, nbytes, tensors}`` followed by the
bucket's bytes cut into ``frame_bytes`` slices sent with ``copy=False`` (no copy on the learner;
libzmq fans the same buffer out to every subscriber) — then ``weights_end {num_buckets,
bytes}``. Each subscriber checks the order, every bucket's checksum, and the count at the end.

Memory: the publisher tracks each bucket's frames (``track=True``) and, before packing bucket
i, waits until bucket i-1 has left for every subscriber, so at most two packed buckets exist
(plus, under ZeRO-3, the gathered one); packing buffers whose frames have left are reused, as
are a subscriber's receive buffers once the update holding them is ``done()`` (warm memory:
no page faults on the next version), which is why its tensors are valid only until then. A subscriber that dies mid-broadcast drops its
connection, and with it its queue: the others are not held up. A live subscriber that stops
reading holds the wait up to ``send_timeout_s``; the publisher then logs it, counts a failure
and moves on (the bucket stays queued for that subscriber, at most ``SNDHWM`` buckets).

| socket | blocks | dropped |
| --- | --- | --- |
| PUB (learner) | never on send; ``publish`` waits up to ``send_timeout_s`` per bucket for the slowest live subscriber | messages past SNDHWM (16 messages) for a subscriber that has stopped reading; everything before a subscriber joins |
| SUB (generator) | ``newest`` waits up to ``timeout_s`` for each next message once a version has begun (``TimeoutError`` naming it) | nothing: RCVHWM is unlimited, so a generator busy sampling queues versions in its own memory |
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
import zmq

from asyncrl import security, wire
from asyncrl.metrics import WEIGHT_FAILURES
from asyncrl.weights.buckets import HASHES, layout, pack_into, specs_from_wire, specs_to_wire, unpack, verify
from asyncrl.weights.update import WeightSyncError, WeightUpdate

log = logging.getLogger(__name__)

FRAME_BYTES = 1 << 20


class ZmqWeightPublisher:
    """Streams versions bucket by bucket on a PUB socket (see the module docstring)."""

    transport = "zmq"

    def __init__(
        self,
        address: str,
        name: str = "learner.weights.stream",
        frame_bytes: int = FRAME_BYTES,
        send_timeout_s: float = 60.0,
        hash: str = "sum64",
    ):
        if frame_bytes < 1:
            raise ValueError(f"frame_bytes ({frame_bytes}) must be >= 1")
        if send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s ({send_timeout_s}) must be > 0")
        if hash not in HASHES:
            raise ValueError(f"hash ({hash!r}) must be one of {HASHES}")
        self.name = name
        self.hash = hash
        self.frame_bytes = frame_bytes
        self.send_timeout_s = send_timeout_s
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 16)
        security.secure(self.sock, address, bind=True)  # CURVE server when the run asks for it
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stalled = 0  # buckets some live subscriber had not taken within send_timeout_s
        self._spare: list[torch.Tensor] = []  # packing buffers whose frames have left: reused, warm

    def publish(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, meta: dict | None = None
    ) -> dict:
        """Stream every bucket (consumed one at a time); returns {bytes, buckets, seconds}."""
        start = time.perf_counter()
        self.sock.send(wire.encode("weights_begin", {"policy_version": version, **(meta or {})}))
        in_flight: list[tuple[int, list[zmq.MessageTracker], torch.Tensor]] = []
        total = count = 0
        for index, named in enumerate(buckets):
            if in_flight:  # bucket i-1 must have left before bucket i is packed: two buckets at most
                sent = in_flight.pop(0)
                if self._wait_sent(version, sent[0], sent[1]):
                    self._spare.append(sent[2])
            specs, size = layout(named)
            buf = self._buffer(max(size, 1))
            crc = pack_into(named, specs, buf, self.hash)
            header = wire.encode(
                "weights_bucket",
                {
                    "policy_version": version,
                    "index": index,
                    "crc": crc,
                    "hash": self.hash,
                    "nbytes": buf.numel(),
                    "tensors": specs_to_wire(specs),
                },
            )
            view = memoryview(buf.numpy())
            parts = [view[o : o + self.frame_bytes] for o in range(0, len(view), self.frame_bytes)]
            self.sock.send(header, zmq.SNDMORE)
            trackers = []
            for i, part in enumerate(parts):
                trackers.append(self.sock.send(part, 0 if i == len(parts) - 1 else zmq.SNDMORE, copy=False, track=True))
            in_flight.append((index, trackers, buf))
            total += buf.numel()
            count += 1
        for index, trackers, buf in in_flight:
            if self._wait_sent(version, index, trackers):
                self._spare.append(buf)
        self._spare = self._spare[-2:]
        self.sock.send(wire.encode("weights_end", {"policy_version": version, "num_buckets": count, "bytes": total}))
        return {"bytes": total, "buckets": count, "seconds": time.perf_counter() - start}

    def _buffer(self, size: int) -> torch.Tensor:
        """A packing buffer of ``size`` bytes, from a spare one when one is big enough."""
        for i, spare in enumerate(self._spare):
            if spare.numel() >= size:
                return self._spare.pop(i)[:size]
        return torch.empty(size, dtype=torch.uint8)

    def _wait_sent(self, version: int, index: int, trackers: list) -> bool:
        """Wait until a bucket's frames have left for every subscriber; False past the timeout."""
        deadline = time.monotonic() + self.send_timeout_s
        for t in trackers:
            left = deadline - time.monotonic()
            try:
                t.wait(max(left, 0.001))
            except zmq.NotDone:
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

    def close(self) -> None:
        self.sock.close()


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
        security.secure(self.sock, address, bind=False)
        self.sock.connect(address)
        self._spare: list[bytearray] = []  # receive buffers of versions applied: reused, warm

    def _recv(self, timeout: float, what: str) -> list[zmq.Frame]:
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"{self.name}: waited {timeout:.1f} s for {what} from {self.address}")
        return self.sock.recv_multipart(copy=False)

    def newest(self, served_version: int, timeout: float = 0.0) -> WeightUpdate | None:
        """Take every message queued (waiting up to ``timeout`` s for the first); once a version
        has begun, wait up to ``timeout_s`` for each of its next messages. Returns the newest
        complete version above ``served_version``, or None."""
        best = None
        wait = timeout
        while self.sock.poll(int(wait * 1000), zmq.POLLIN):
            wait = 0
            frames = self.sock.recv_multipart(copy=False)
            kind, body = wire.decode(frames[0].bytes)
            if kind != "weights_begin":
                continue  # the tail of a version that began before we joined
            update = self._receive_version(body)
            if update.version > served_version and (best is None or update.version > best.version):
                best = update
        return best

    def _receive_version(self, begin: dict) -> WeightUpdate:
        start = time.perf_counter()
        version = int(begin["policy_version"])
        tensors, total, index = [], 0, 0
        buffers: list[bytearray] = []
        while True:
            frames = self._recv(self.timeout_s, f"bucket {index} (or the end) of version {version}")
            kind, body = wire.decode(frames[0].bytes)
            if int(body.get("policy_version", -1)) != version or kind not in ("weights_bucket", "weights_end"):
                raise WeightSyncError(
                    f"{self.name}: version {version} interrupted by {kind} of version {body.get('policy_version')}"
                )
            if kind == "weights_end":
                if int(body["num_buckets"]) != index:
                    raise WeightSyncError(
                        f"{self.name}: version {version} ended after {index} buckets, the learner sent {body['num_buckets']}"
                    )
                meta = {k: v for k, v in begin.items() if k != "policy_version"}
                update = WeightUpdate(version, tensors, meta, total, time.perf_counter() - start)
                update._on_done = lambda error: self._spare.extend(buffers)
                return update
            if int(body["index"]) != index:
                raise WeightSyncError(
                    f"{self.name}: version {version}: got bucket {body['index']}, expected {index} (frames were dropped)"
                )
            got = sum(len(f.buffer) for f in frames[1:])
            if got != int(body["nbytes"]):
                raise WeightSyncError(
                    f"{self.name}: version {version} bucket {index}: {got} bytes, expected {body['nbytes']}"
                )
            data = self._recv_buffer(got)  # one copy out of the frames: tensors need contiguous memory
            buffers.append(data)
            view, offset = memoryview(data), 0
            for f in frames[1:]:
                view[offset : offset + len(f.buffer)] = f.buffer
                offset += len(f.buffer)
            verify(data, int(body["crc"]), f"{self.name}: version {version} bucket {index}", body.get("hash", "crc32"))
            tensors.extend(unpack(data, specs_from_wire(body["tensors"])))
            total += len(data)
            index += 1

    def _recv_buffer(self, size: int) -> bytearray:
        for i, spare in enumerate(self._spare):
            if len(spare) == size:
                return self._spare.pop(i)
        return bytearray(size)

    def close(self) -> None:
        self.sock.close()
