"""Weights leave the learner in size-capped buckets: plan, gather, pack, checksum, unpack.

A *bucket* is a run of parameters whose bytes together stay under ``bucket_bytes`` (a tensor
larger than the cap is a bucket of its own). ``iter_buckets(module, bucket_bytes)`` walks a
model's parameters in order and yields one bucket at a time as ``[(name, tensor)]``; under
ZeRO-3 it gathers that bucket's partitions with ``deepspeed.zero.GatheredParameters`` for the
duration of the ``yield`` only, so the caller must copy what it needs (``pack_into``) before it
asks for the next one. Peak extra memory is then one gathered bucket plus what the transport
keeps (one or two packed buckets), never the whole model.

A packed bucket is the tensors' raw bytes back to back, each at an offset aligned to
``ALIGN`` bytes, described by a list of ``TensorSpec`` and guarded by one checksum of the whole
buffer (``HASHES``: Fletcher-64, xxh3-64 or a 64-bit word sum, CRC-32 on request).
``unpack`` returns zero-copy views of a buffer (shared memory, a ZeroMQ frame).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from asyncrl.weights.update import WeightSyncError

ALIGN = 64
"""Byte alignment of every tensor inside a packed bucket (a cache line; any dtype's itemsize divides it)."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lies in a packed bucket."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket buffer
    nbytes: int

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, item: list) -> TensorSpec:
        name, dtype, shape, offset, nbytes = item
        return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorSpec], int]:
    """Specs of ``named`` packed back to back (aligned) and the bucket's total bytes."""
    specs, offset = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset = _align(offset + nbytes)
    return specs, offset


def pack_into(
    named: list[tuple[str, torch.Tensor]], specs: list[TensorSpec], buf, algo: str | None = "sum64"
) -> int | None:
    """Copy each tensor's bytes into ``buf`` (a writable buffer of the bucket's size) at its
    spec's offset (one copy, device to host included); return the ``algo`` checksum of the whole
    buffer (padding included: it is zeroed), or None without ``algo``."""
    dst = torch.frombuffer(buf, dtype=torch.uint8) if not isinstance(buf, torch.Tensor) else buf
    for (_name, t), spec in zip(named, specs):
        pack_tensor(dst, t, spec)
    zero_padding(dst, specs)
    if algo is None:
        return None
    return checksum(dst.numpy(), algo) if dst.device.type == "cpu" else device_checksum(dst, algo)


def pack_tensor(dst: torch.Tensor, t: torch.Tensor, spec: TensorSpec) -> None:
    """Copy one tensor's bytes to its place in a bucket buffer (device to host in the same copy)."""
    src = t.detach()
    src = src if src.is_contiguous() else src.contiguous()
    dst[spec.offset : spec.offset + spec.nbytes].copy_(src.reshape(-1).view(torch.uint8))


def zero_padding(dst: torch.Tensor, specs: list[TensorSpec]) -> None:
    """Zero the bytes of a bucket buffer between and after its tensors (they count in its checksum)."""
    end = 0
    for spec in specs:
        if spec.offset > end:
            dst[end : spec.offset].zero_()
        end = spec.offset + spec.nbytes
    if dst.numel() > end:
        dst[end:].zero_()


HASHES = ("fletcher64", "xxh3", "sum64", "crc32")
"""Bucket checksums, all read at memory speed but CRC-32. ``fletcher64`` (the zmq stream's
default; ``asyncrl.weights.fletcher``) is Fletcher's two running sums of the 8-byte words,
mixed by XXH3 into 64 bits: order-sensitive, and summed in the same pass that copies a frame to
its place (``Digest.copy``), so a subscriber's check costs little beyond the copy it makes anyway. ``xxh3`` (xxHash's
XXH3, 64 bits) runs at ~60 GB/s in cache and ~29 GB/s from memory here, as fast as the
sum, and catches any change of the bytes, reordering included, short of an adversary.
``sum64`` is the sum mod 2^64 of the bucket's 8-byte words (~29 GB/s from memory): it catches
truncation, a zeroed or flipped frame, any change confined to one word; not a reordering of whole
words. It is the default where that additivity is used: the shm publisher sums each tensor on a
second thread while it copies the next, and nccl sums on the GPU. ``crc32`` (zlib) runs at
~2.3 GB/s, slower than the copy it guards: the benchmark's shared-memory path falls from ~50 %
to ~15 % of memcpy with it."""


def checksum(buf, algo: str = "sum64", threads: int = 1) -> int:
    """Checksum of a buffer's bytes (anything with the buffer protocol); see ``HASHES``.

    ``threads`` > 1 sums a large buffer's slices on that many threads at once for ``sum64``
    (numpy releases the GIL): one core does not reach the memory's bandwidth (here ~14 GB/s
    alone, ~21 with two). ``xxh3`` and ``crc32`` run on one thread (their state is sequential).
    """
    if algo == "xxh3":
        return xxhash.xxh3_64_intdigest(buf)
    if algo == "fletcher64":
        digest = Digest(algo)
        digest.update(buf)
        return digest.value()
    if algo == "crc32":
        return zlib.crc32(buf) & 0xFFFFFFFF
    if algo != "sum64":
        raise ValueError(f"checksum algo ({algo!r}) must be one of {HASHES}")
    arr = np.frombuffer(buf, dtype=np.uint8)
    head = len(arr) // 8 * 8
    words = arr[:head].view(np.uint64)
    if threads > 1 and head >= 2 * PARALLEL_MIN_BYTES:
        cut = np.linspace(0, len(words), min(threads, head // PARALLEL_MIN_BYTES) + 1, dtype=np.int64)
        pool = _sum_pool()
        sums = [pool.submit(np.add.reduce, words[a:b], dtype=np.uint64) for a, b in zip(cut[:-1], cut[1:])]
        total = sum(int(s.result()) for s in sums)
    else:
        total = int(np.add.reduce(words, dtype=np.uint64)) if head else 0
    if head < len(arr):
        total += int.from_bytes(arr[head:].tobytes(), "little")
    return total & 0xFFFFFFFFFFFFFFFF


class Digest:
    """A checksum taken piece by piece as the bytes arrive (a frame while it is still in cache).

    For ``xxh3`` and ``crc32`` the value is that of the pieces joined, however they are cut; for
    ``sum64`` and ``fletcher64`` each piece must start 8-aligned within the bytes it was cut
    from (a tensor's frames do): a piece's tail is a word of its own.

        >>> d = Digest("xxh3"); d.update(b"weig"); d.update(b"hts"); d.value() == checksum(b"weights", "xxh3")
        True
    """

    def __init__(self, algo: str):
        if algo not in HASHES:
            raise ValueError(f"checksum algo ({algo!r}) must be one of {HASHES}")
        self.algo = algo
        self._xxh3 = xxhash.xxh3_64() if algo == "xxh3" else None
        self._fletcher = None
        if algo == "fletcher64":  # here, not at the top: numba is imported only by who uses it
            from asyncrl.weights.fletcher import Fletcher64

            self._fletcher = Fletcher64()
        self._total = 0

    def update(self, data) -> None:
        """Add the next piece (anything with the buffer protocol)."""
        if self._fletcher is not None:
            self._fletcher.update(data)
        elif self._xxh3 is not None:
            self._xxh3.update(data)
        elif self.algo == "crc32":
            self._total = zlib.crc32(data, self._total) & 0xFFFFFFFF
        else:
            self._total = (self._total + checksum(data, "sum64")) & 0xFFFFFFFFFFFFFFFF

    def copy(self, data, out) -> None:
        """Add the next piece and copy it into ``out`` (writable, the same length): in one pass
        for ``fletcher64``, the bytes read once and written past the cache; else a sum, then a copy."""
        if self._fletcher is not None:
            self._fletcher.copy(data, out)
        else:
            self.update(data)
            memoryview(out).cast("B")[:] = memoryview(data).cast("B")

    def value(self) -> int:
        if self._fletcher is not None:
            return self._fletcher.intdigest()
        return self._xxh3.intdigest() if self._xxh3 is not None else self._total


PARALLEL_MIN_BYTES = 4 << 20
"""Smallest slice ``checksum`` gives a thread: below it, handing work over costs more than it saves."""

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _sum_pool() -> ThreadPoolExecutor:
    """The threads that sum slices, started on first use (most processes never check a bucket)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="asyncrl.checksum")
        return _POOL


CHECK_THREADS = 2
"""Threads that check one bucket on arrival (``verify``): the checksum of the last bucket is in a
broadcast's critical path, after the learner is done, when the host's cores are free."""


def device_checksum(buf: torch.Tensor, algo: str = "sum64") -> int:
    """``sum64`` of a uint8 tensor on any device, computed there (one int64 sum: wrapping two's
    complement addition is the same sum mod 2^64); its length must be a multiple of 8. CRC-32
    has no device kernel: it is refused rather than copied back to the host."""
    if algo != "sum64":
        raise ValueError(f"checksum algo ({algo!r}) on device {buf.device} must be 'sum64' (weights.checksum)")
    if buf.numel() % 8:
        raise ValueError(f"a device buffer's length ({buf.numel()}) must be a multiple of 8")
    return int(buf.view(torch.int64).sum().item()) & 0xFFFFFFFFFFFFFFFF


def unpack(buf, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy ``(name, tensor)`` views of a packed bucket; they keep ``buf`` alive."""
    flat = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(buf, dtype=torch.uint8)
    out = []
    for s in specs:
        dtype = getattr(torch, s.dtype)
        out.append((s.name, flat[s.offset : s.offset + s.nbytes].view(dtype).view(s.shape)))
    return out


def verify(buf, crc: int, what: str, algo: str = "sum64") -> None:
    """Raise ``WeightSyncError`` naming ``what`` when the buffer's ``algo`` checksum is not ``crc``."""
    got = checksum(buf, algo, threads=CHECK_THREADS)
    if got != crc:
        raise WeightSyncError(
            f"{what}: {algo} checksum mismatch (got {got:#x}, expected {crc:#x}): corrupted in transit"
        )


class Bucket(list):
    """A bucket: ``[(name, tensor)]``; ``transient`` when its tensors are freed at the next
    ``next()`` (a ZeRO-3 gather), so a transport must copy them rather than keep references."""

    transient: bool = False


def cast_buckets(buckets: Iterator, dtype: str) -> Iterator:
    """``buckets`` with their floating-point tensors cast to ``dtype`` (``weights.dtype``), one
    bucket at a time as the publisher asks for it; ``"model"`` leaves them as they are. A
    bucket stays ``transient`` if it was: its uncast tensors are still the gather's.

    >>> b = Bucket([("w", torch.ones(2)), ("step", torch.tensor([3]))])
    >>> [(n, t.dtype) for n, t in next(cast_buckets(iter([b]), "bfloat16"))]
    [('w', torch.bfloat16), ('step', torch.int64)]
    """
    if dtype == "model":
        yield from buckets
        return
    target = getattr(torch, dtype)
    for bucket in buckets:
        cast = Bucket((name, t.to(target) if t.is_floating_point() else t) for name, t in bucket)
        cast.transient = getattr(bucket, "transient", False)
        yield cast


def _full_numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def plan_buckets(module: torch.nn.Module, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group the module's parameters (tied ones once) and persistent buffers into runs under
    ``bucket_bytes`` of full (gathered) size, in ``named_parameters`` order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be >= 1")
    items: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                items.append((f"{mod_name}.{name}" if mod_name else name, buf))
    plans: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in items:
        nbytes = _full_numel(t) * t.element_size()
        if current and size + nbytes > bucket_bytes:
            plans.append(current)
            current, size = [], 0
        current.append((name, t))
        size += _align(nbytes)
    if current:
        plans.append(current)
    return plans


def iter_buckets(module: torch.nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the module's weights one size-capped bucket at a time, gathered if ZeRO-3 partitioned.

    Collective under ZeRO-3: every rank must iterate to the end. The yielded tensors are valid
    only until the next ``next()`` (the gathered storage is freed then): copy them out first.

    >>> m = torch.nn.Linear(4, 2)
    >>> [[n for n, _ in b] for b in iter_buckets(m, bucket_bytes=32)]
    [['weight'], ['bias']]
    """
    for whole in plan_buckets(module, bucket_bytes):
        for plan in swap_limited(whole):
            partitioned = [t for _, t in plan if hasattr(t, "ds_id")]
            if partitioned:
                import deepspeed

                with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
                    bucket = Bucket((name, t.detach()) for name, t in plan)
                    bucket.transient = True
                    yield bucket
            else:
                yield Bucket((name, t.detach()) for name, t in plan)


def swap_limited(plan: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """``plan`` cut, in order, into runs that each hold at most as many NVMe-swapped ZeRO-3
    parameters as DeepSpeed's parameter swapper has buffers (``offload_param.buffer_count``, 5):
    it reads every such parameter of a gather into a buffer of its own, and fails a gather of more
    ("Not enough buffers"). Where is a property of the partition, the same on every rank, so the
    ranks cut alike and their gathers pair up. One run when nothing is on NVMe."""
    runs: list[list[tuple[str, torch.Tensor]]] = [[]]
    swapped = 0
    for name, t in plan:
        swapper = getattr(t, "nvme_swapper", None)
        on_nvme = swapper is not None and getattr(getattr(t, "ds_tensor", None), "final_location", None) == "nvme"
        if on_nvme:
            if swapped == swapper.param_buffer_count:
                runs.append([])
                swapped = 0
            swapped += 1
        runs[-1].append((name, t))
    return runs


def state_dict_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``iter_buckets`` for a plain state dict (tests, benchmarks, the mock trainer)."""
    current, size = [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, t))
        size += _align(nbytes)
    if current:
        yield current


def specs_to_wire(specs: list[TensorSpec]) -> list[list]:
    return [s.to_wire() for s in specs]


def specs_from_wire(items: list) -> list[TensorSpec]:
    return [TensorSpec.from_wire(i) for i in items]


__all__ = [
    "ALIGN",
    "Bucket",
    "TensorSpec",
    "WeightSyncError",
    "HASHES",
    "checksum",
    "device_checksum",
    "iter_buckets",
    "layout",
    "pack_into",
    "pack_tensor",
    "plan_buckets",
    "specs_from_wire",
    "specs_to_wire",
    "state_dict_buckets",
    "unpack",
    "verify",
    "zero_padding",
]
