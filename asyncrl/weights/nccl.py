"""GPU-to-GPU weight broadcast: an NCCL group of learner rank 0 and every generator.

The group is its own, apart from the learner's DeepSpeed group: a ``TCPStore`` served by the
publisher, a ``ProcessGroupNCCL`` built on it directly (rank 0 the learner, ranks 1..G the
generators), so neither side needs ``init_process_group`` or touches the other's default group.
Per version:

1. the learner announces ``{policy_version, transport: nccl, store: HOST:PORT, world_size, probe...}``
   on its ZeroMQ PUB socket (repeated every second, as for shared memory): a generator that sees
   it joins the group the first time and takes the version;
2. for bucket i it packs the tensors into a device buffer (no host copy), writes the bucket's
   header ``{nbytes, crc, tensors}`` into the store under ``v{version}/b{i}`` and broadcasts the
   buffer; after the last bucket the key ``v{version}/b{n}`` holds ``{end, num_buckets, bytes}``;
3. each generator reads header i from the store, receives bucket i into a device buffer, checks
   its ``sum64`` checksum on the device, and hands out views of the buffers.

Collectives need everyone: the learner's ``publish`` waits up to ``timeout_s`` for every
generator to take each bucket, and a generator waits up to ``timeout_s`` for each header and
each bucket; past it the wait is raised naming the version and bucket it waited for. A
generator that dies mid-broadcast therefore fails the broadcast (the learner raises; NCCL's
watchdog aborts the group): unlike ``zmq``, NCCL cannot leave one peer behind. In
``between_requests`` mode a generator joins between engine calls, so ``timeout_s`` must cover
one engine call; ``in_flight`` joins at once. At most two buckets are in flight on the learner.

``backend="gloo"`` runs the same code on CPU tensors (tests on machines without GPUs); the
``nccl`` transport of the config always means NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import torch

from asyncrl.weights.announcer import VersionAnnouncer
from asyncrl.weights.buckets import device_checksum, layout, pack_into, specs_from_wire, specs_to_wire, unpack
from asyncrl.weights.update import WeightSyncError, WeightUpdate
from asyncrl.wire.sockets import Subscriber

if TYPE_CHECKING:
    from asyncrl.wire.messages import WeightsAnnouncement

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
PREFIX = "asyncrl-weights"
JOINED = "joined"  # store counter: generators that have joined the group


def make_group(backend: str, store, rank: int, world_size: int, timeout_s: float):
    """A process group of ``backend`` on ``store`` alone (no default group needed)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.PrefixStore(PREFIX, store)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout=timeout)
    raise ValueError(f"backend ({backend!r}) must be one of {BACKENDS}")


def broadcast(group, buf: torch.Tensor, timeout_s: float, what: str) -> None:
    """Broadcast ``buf`` from rank 0 and wait, polling, up to ``timeout_s`` (NCCL's own ``wait``
    only orders CUDA streams; polling makes the host wait, with a deadline)."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    work = group.broadcast([buf], options)
    wait(work, timeout_s, what)


def wait(work, timeout_s: float, what: str, tick=None) -> None:
    """Wait for ``work`` up to ``timeout_s``, calling ``tick()`` meanwhile; raise naming ``what``."""
    deadline = time.monotonic() + timeout_s
    try:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise WeightSyncError(f"waited {timeout_s:.1f} s for {what}")
            if tick is not None:
                tick()
            time.sleep(0.0005)
        work.wait()
    except WeightSyncError:
        raise
    except Exception as e:  # the backend's own error (a peer gone, the group aborted)
        raise WeightSyncError(f"{what} failed: {type(e).__name__}: {e}") from e


def _padded(nbytes: int) -> int:
    return max(8, (nbytes + 7) // 8 * 8)  # sum64 on the device reads whole 8-byte words


class NcclWeightPublisher:
    """Learner rank 0's side (see the module docstring).

    On a CUDA learner (so not a doctest; the gpu-marked tests run it)::

        pub = NcclWeightPublisher("tcp://127.0.0.1:0", num_subscribers=2)
        pub.publish(trainer.weight_buckets(64 << 20), version=1)
    """

    transport = "nccl"

    def __init__(
        self,
        address: str,
        num_subscribers: int,
        name: str = "learner.weights.nccl",
        timeout_s: float = 60.0,
        hash: str = "sum64",
        backend: str = "nccl",
        device: torch.device | str | None = None,
    ):
        if num_subscribers < 1:
            raise ValueError(f"num_subscribers ({num_subscribers}) must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        if hash != "sum64":
            raise ValueError(f"hash ({hash!r}) must be 'sum64' with nccl (weights.checksum): it is computed on the GPU")
        if backend not in BACKENDS:
            raise ValueError(f"backend ({backend!r}) must be one of {BACKENDS}")
        self.name = name
        self.hash = hash
        self.backend = backend
        self.timeout_s = timeout_s
        self.world_size = num_subscribers + 1
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.announcer = VersionAnnouncer(address, name=name)
        self.address = self.announcer.address
        host = urlparse(self.address).hostname or "127.0.0.1"
        self.store = torch.distributed.TCPStore(
            host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.store_address = f"{host}:{self.store.port}"
        self.group = None  # formed at the first publish, when the generators join
        self._spare: list[torch.Tensor] = []  # device buffers whose broadcast is done: reused

    def publish(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, meta: dict | None = None
    ) -> dict:
        """Announce, then broadcast every bucket (consumed one at a time); returns {bytes, buckets, seconds}."""
        start = time.perf_counter()
        self.announcer.set(
            {
                "policy_version": version,
                "transport": self.transport,
                "store": self.store_address,
                "world_size": self.world_size,
                **(meta or {}),
            }
        )
        if self.group is None:
            try:
                self.group = make_group(self.backend, self.store, 0, self.world_size, self.timeout_s)
            except Exception as e:  # gloo meets every rank here, within the timeout
                raise WeightSyncError(
                    f"{self.name}: waited {self.timeout_s:.1f} s to form the {self.backend} group with "
                    f"{self.world_size - 1} generators at {self.store_address}: {type(e).__name__}"
                ) from e
            self._wait_joined()
        in_flight: list[tuple[int, object, torch.Tensor]] = []
        total = count = 0
        for index, named in enumerate(buckets):
            if len(in_flight) == 2:  # two buckets at most: the oldest must have left first
                self._finish(version, *in_flight.pop(0))
            specs, size = layout(named)
            buf = self._buffer(_padded(size))
            crc = pack_into(named, specs, buf, self.hash)
            header = {"nbytes": buf.numel(), "crc": crc, "hash": self.hash, "tensors": specs_to_wire(specs)}
            self.store.set(f"v{version}/b{index}", json.dumps(header))
            options = torch.distributed.BroadcastOptions()
            options.rootRank, options.rootTensor = 0, 0
            in_flight.append((index, self.group.broadcast([buf], options), buf))
            total += buf.numel()
            count += 1
        for item in in_flight:
            self._finish(version, *item)
        self.store.set(f"v{version}/b{count}", json.dumps({"end": True, "num_buckets": count, "bytes": total}))
        self._forget(version - 2)
        return {"bytes": total, "buckets": count, "seconds": time.perf_counter() - start}

    def _wait_joined(self) -> None:
        """Wait until every generator has joined: NCCL's first collective sets the communicator
        up and would block, with no deadline of ours, on a generator that never comes."""
        deadline = time.monotonic() + self.timeout_s
        while (joined := self.store.add(JOINED, 0)) < self.world_size - 1:
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{self.name}: waited {self.timeout_s:.1f} s for {self.world_size - 1} generators to join the "
                    f"{self.backend} group at {self.store_address}; {joined} did"
                )
            self.announce()  # a generator that missed the announcement hears it again
            time.sleep(0.01)

    def _finish(self, version: int, index: int, work, buf: torch.Tensor) -> None:
        what = f"{self.name}: every generator to take version {version} bucket {index} over {self.backend}"
        wait(work, self.timeout_s, what, tick=self.announce)  # a generator that missed it hears it again
        self._spare.append(buf)
        self._spare = self._spare[-2:]

    def _buffer(self, size: int) -> torch.Tensor:
        for i, spare in enumerate(self._spare):
            if spare.numel() >= size:
                return self._spare.pop(i)[:size]
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _forget(self, version: int) -> None:
        """Drop the store keys of a version every generator has taken (they are small, but add up)."""
        index = 0
        while version > 0 and self.store.check([f"v{version}/b{index}"]):
            self.store.delete_key(f"v{version}/b{index}")
            index += 1

    def announce(self, force: bool = False) -> None:
        """Repeat the newest announcement (at most once a second unless forced)."""
        self.announcer.announce(force)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        self.announcer.close()
        self.group = None


class NcclWeightSubscriber:
    """A generator's side: joins the group on the first announcement, receives every version."""

    transport = "nccl"

    def __init__(
        self,
        address: str,
        rank: int,
        name: str = "generator.weights.nccl",
        timeout_s: float = 60.0,
        backend: str = "nccl",
        device: torch.device | str | None = None,
    ):
        if rank < 1:
            raise ValueError(f"rank ({rank}) must be >= 1 (rank 0 is the learner)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        if backend not in BACKENDS:
            raise ValueError(f"backend ({backend!r}) must be one of {BACKENDS}")
        self.name = name
        self.rank = rank
        self.timeout_s = timeout_s
        self.backend = backend
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.sub = Subscriber(address, name=name)
        self.group = None
        self.store = None
        self.received = -1  # newest version taken from the group

    def newest(self, served_version: int, timeout: float = 0.0) -> WeightUpdate | None:
        """Receive the newest announced version above ``served_version`` (waiting up to ``timeout``
        s for an announcement); None when there is none. The learner broadcasts one version at a
        time and waits for every generator, so a version announced is one to take now."""
        best = None
        msg = self.sub.recv(timeout) if timeout > 0 else None
        for kind, body in ([msg] if msg else []) + self.sub.recv_latest():
            if kind != "weights":
                continue
            v = body.policy_version
            if v > max(served_version, self.received):
                if best is None or v > best.policy_version:
                    best = body
        return None if best is None else self.receive(best)

    def _join(self, body: WeightsAnnouncement) -> None:
        world = int(body.world_size)
        if not self.rank < world:
            raise WeightSyncError(f"{self.name}: rank {self.rank} is outside the learner's group of {world}")
        host, port = str(body.store).rsplit(":", 1)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self.store = torch.distributed.TCPStore(host, int(port), None, False, timeout=timeout)
            self.group = make_group(self.backend, self.store, self.rank, world, self.timeout_s)
            self.store.add(JOINED, 1)
        except Exception as e:
            raise WeightSyncError(
                f"{self.name}: waited {self.timeout_s:.1f} s to join the learner's {self.backend} group at {body.store} "
                f"as rank {self.rank} of {world}: {type(e).__name__}: {e}"
            ) from e

    def _header(self, key: str, what: str) -> dict:
        try:
            return json.loads(self.store.get(key))
        except Exception as e:
            raise TimeoutError(f"{self.name}: waited {self.timeout_s:.1f} s for {what}: {type(e).__name__}") from e

    def receive(self, body: WeightsAnnouncement) -> WeightUpdate:
        """Take the version ``body`` announces from the group: every bucket, checked."""
        start = time.perf_counter()
        version = body.policy_version
        if self.group is None:
            self._join(body)
        tensors, buffers, total, index = [], [], 0, 0
        while True:
            header = self._header(f"v{version}/b{index}", f"bucket {index} (or the end) of version {version}")
            if header.get("end"):
                if int(header["num_buckets"]) != index:
                    raise WeightSyncError(
                        f"{self.name}: version {version} ended after {index} buckets, the learner sent {header['num_buckets']}"
                    )
                break
            # Freed when the update is done; the CUDA caching allocator hands the same blocks back next time.
            buf = torch.empty(int(header["nbytes"]), dtype=torch.uint8, device=self.device)
            broadcast(
                self.group, buf, self.timeout_s, f"{self.name}: version {version} bucket {index} over {self.backend}"
            )
            got = device_checksum(buf, header.get("hash", "sum64"))
            if got != int(header["crc"]):
                raise WeightSyncError(
                    f"{self.name}: version {version} bucket {index}: sum64 checksum mismatch (got {got:#x}, "
                    f"expected {int(header['crc']):#x}): corrupted in transit"
                )
            buffers.append(buf)
            tensors.extend(unpack(buf, specs_from_wire(header["tensors"])))
            total += buf.numel()
            index += 1
        self.received = version
        meta = {
            k: v for k, v in body.as_dict().items() if k not in ("policy_version", "transport", "store", "world_size")
        }
        update = WeightUpdate(version, tensors, meta, total, time.perf_counter() - start)
        update._on_done = lambda error: buffers.clear()
        return update

    def close(self) -> None:
        self.sub.close()
        self.group = None
