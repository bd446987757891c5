"""The file transport: one safetensors file per version (``asyncrl.weights.file_writer``) behind the
publisher/subscriber interface. It keeps a whole-model copy in the learner while writing; use
it to debug, or where generators share a filesystem but not a host."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from asyncrl.weights.file_writer import WeightPublisher
from asyncrl.weights.update import WeightUpdate
from asyncrl.wire.sockets import Subscriber


class FileWeightPublisher:
    transport = "file"

    def __init__(self, address: str, root: Path, keep: int = 3):
        self._pub = WeightPublisher(address, root, keep)
        self.address = self._pub.pub.address

    def publish(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, meta: dict | None = None
    ) -> dict:
        start = time.perf_counter()
        state = {name: t.detach().to("cpu").clone() for named in buckets for name, t in named}
        self._pub.publish(state, version)
        if meta:
            self._pub.latest.update(meta)
            self._pub.announce(force=True)
        return {
            "bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "buckets": 1,
            "seconds": time.perf_counter() - start,
        }

    def announce(self, force: bool = False) -> None:
        self._pub.announce(force)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        self._pub.close()


class FileWeightSubscriber:
    transport = "file"

    def __init__(self, address: str, name: str = "generator.weights"):
        self.sub = Subscriber(address, name=name)

    def newest(self, served_version: int, timeout: float = 0.0) -> WeightUpdate | None:
        best = None
        msg = self.sub.recv(timeout) if timeout > 0 else None
        for kind, body in ([msg] if msg else []) + self.sub.recv_latest():
            v = int(body["policy_version"])
            if kind == "weights" and v > served_version and (best is None or v > int(best["policy_version"])):
                best = body
        if best is None:
            return None
        meta = {k: v for k, v in best.items() if k not in ("policy_version", "path")}
        return WeightUpdate(int(best["policy_version"]), [], meta, path=best["path"])

    def close(self) -> None:
        self.sub.close()
