"""Publishing weights to the generators: write a version to disk, announce it over PUB.

Transport for now: a safetensors file in ``RUN_DIR/weights/v{version:06d}/`` written to a temporary
directory and renamed (a generator never sees half a file), announced as
``{"policy_version", "path"}`` on the learner's publisher. The announcement is repeated every
second, because a PUB socket drops everything sent before a subscriber joined; generators ignore
versions they already serve. Only the newest ``keep`` versions stay on disk.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.wire.sockets import Publisher


def write_weights(state_dict: dict[str, torch.Tensor], root: Path, version: int) -> Path:
    """Write ``state_dict`` atomically as ``root/v{version}/model.safetensors``; return the folder."""
    final = root / f"v{version:06d}"
    tmp = root / f".v{version:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"policy_version": str(version)})
    with open(tmp / "model.safetensors", "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


class WeightPublisher:
    """Writes versions and announces the newest one to every generator, repeatedly."""

    def __init__(self, address: str, root: Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be >= 1")
        self.root = root
        self.keep = keep
        self.pub = Publisher(address, name="learner.weights")
        self.latest: dict | None = None
        self._last_sent = 0.0

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> Path:
        path = write_weights(state_dict, self.root, version)
        self.latest = {"policy_version": version, "path": str(path)}
        self.announce(force=True)
        self._prune()
        return path

    def announce(self, force: bool = False) -> None:
        """Repeat the newest announcement (at most once a second unless forced)."""
        now = time.monotonic()
        if self.latest is not None and (force or now - self._last_sent > 1.0):
            self.pub.send("weights", self.latest)
            self._last_sent = now

    def _prune(self) -> None:
        versions = sorted(p for p in self.root.glob("v*") if p.is_dir())
        for old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.pub.close()
