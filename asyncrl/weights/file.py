"""The file transport: one safetensors file per version (``asyncrl.weights.file_writer``), announced
as ``{policy_version, path, ...meta}`` and repeated every second (``asyncrl.weights.announcer``).
It keeps a whole-model copy in the learner while writing; use it to debug, or where generators
share a filesystem but not a host. Only the newest ``keep`` versions stay on disk."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from asyncrl.weights.announcer import VersionAnnouncer
from asyncrl.weights.file_writer import prune_versions, write_weights
from asyncrl.weights.update import WeightUpdate
from asyncrl.wire.sockets import Subscriber


class FileWeightPublisher:
    transport = "file"

    def __init__(self, address: str, root: Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be >= 1")
        self.root = Path(root)
        self.keep = keep
        self.announcer = VersionAnnouncer(address, name="learner.weights")
        self.address = self.announcer.address

    def publish(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, meta: dict | None = None
    ) -> dict:
        start = time.perf_counter()
        state = {name: t.detach().to("cpu").clone() for named in buckets for name, t in named}
        path = write_weights(state, self.root, version)
        self.announcer.set({"policy_version": version, "path": str(path), **(meta or {})})
        prune_versions(self.root, self.keep)
        return {
            "bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "buckets": 1,
            "seconds": time.perf_counter() - start,
        }

    def announce(self, force: bool = False) -> None:
        self.announcer.announce(force)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        self.announcer.close()


class FileWeightSubscriber:
    transport = "file"

    def __init__(self, address: str, name: str = "generator.weights"):
        self.sub = Subscriber(address, name=name)

    def newest(self, served_version: int, timeout: float = 0.0) -> WeightUpdate | None:
        best = None
        msg = self.sub.recv(timeout) if timeout > 0 else None
        for kind, body in ([msg] if msg else []) + self.sub.recv_latest():
            if kind != "weights":
                continue
            v = body.policy_version
            if v > served_version and (best is None or v > best.policy_version):
                best = body
        if best is None:
            return None
        meta = {k: v for k, v in best.as_dict().items() if k not in ("policy_version", "path")}
        return WeightUpdate(best.policy_version, [], meta, path=best.path)

    def close(self) -> None:
        self.sub.close()
