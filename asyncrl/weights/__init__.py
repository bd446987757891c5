"""Weight broadcast from the learner to the generators: buckets, transports, schedule, probe.

One small interface, four transports (``file``, ``shm``, ``zmq``, ``nccl``):

- publisher (learner rank 0): ``publish(buckets, version, meta) -> {bytes, buckets, seconds}``
  consumes an iterator of buckets (``iter_buckets``: gathered one at a time under ZeRO-3);
  ``announce()`` in the learner's idle loop (repeats, acks); ``close()``.
- subscriber (generator): ``newest(served_version, timeout=0) -> WeightUpdate | None``, the
  newest complete, checksum-verified version above the one served; ``close()``. The generator
  calls ``update.done(error)`` once the engine has copied the tensors in.

``make_publisher`` / ``make_subscriber`` pick the transport from ``WeightSyncConfig``. How a
generator applies an update (between engine calls, or in flight with per-token version
segments) is ``weights.apply_mode``: see ``asyncrl.generators.process`` and ``.inflight``.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.weights.config import WeightSyncConfig
from asyncrl.weights.schedule import BroadcastSchedule
from asyncrl.weights.update import WeightSyncError, WeightUpdate

# Buckets (torch) load with the transports: importing this package stays cheap for configs.

MiB = 1 << 20


def make_publisher(
    cfg: WeightSyncConfig, announce_address: str, stream_address: str | None, run_dir: Path, num_subscribers: int = 1
):
    """The learner's publisher for ``cfg.transport`` (``num_subscribers``: the generators, for nccl's group)."""
    if cfg.transport == "nccl":
        from asyncrl.weights.nccl import NcclWeightPublisher

        return NcclWeightPublisher(
            announce_address, num_subscribers=num_subscribers, timeout_s=cfg.timeout_s, hash=cfg.checksum
        )
    if cfg.transport == "shm":
        from asyncrl.weights.shm import ShmWeightPublisher

        return ShmWeightPublisher(announce_address, keep_s=cfg.keep_s, hash=cfg.checksum)
    if cfg.transport == "zmq":
        from asyncrl.weights.stream import ZmqWeightPublisher

        if stream_address is None:
            raise ValueError("weights.transport zmq needs the endpoint weights_stream")
        return ZmqWeightPublisher(
            stream_address, frame_bytes=int(cfg.frame_mb * MiB), send_timeout_s=cfg.timeout_s, hash=cfg.checksum
        )
    from asyncrl.weights.file import FileWeightPublisher

    return FileWeightPublisher(announce_address, Path(run_dir) / "weights")


def make_subscriber(cfg: WeightSyncConfig, announce_address: str, stream_address: str | None, name: str, rank: int = 1):
    """A generator's subscriber for ``cfg.transport`` (``rank``: its place in nccl's group, 1..G)."""
    if cfg.transport == "nccl":
        from asyncrl.weights.nccl import NcclWeightSubscriber

        return NcclWeightSubscriber(announce_address, rank=rank, name=name, timeout_s=cfg.timeout_s)
    if cfg.transport == "shm":
        from asyncrl.weights.shm import ShmWeightSubscriber

        return ShmWeightSubscriber(announce_address, name=name)
    if cfg.transport == "zmq":
        from asyncrl.weights.stream import ZmqWeightSubscriber

        if stream_address is None:
            raise ValueError("weights.transport zmq needs the endpoint weights_stream")
        return ZmqWeightSubscriber(stream_address, name=name, timeout_s=cfg.timeout_s)
    from asyncrl.weights.file import FileWeightSubscriber

    return FileWeightSubscriber(announce_address, name=name)


__all__ = [
    "BroadcastSchedule",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightUpdate",
    "make_publisher",
    "make_subscriber",
]
