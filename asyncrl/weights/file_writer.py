"""Weights on disk for the file transport: one safetensors file per version.

``write_weights`` writes ``RUN_DIR/weights/v{version:06d}/model.safetensors`` into a temporary
directory and renames it (a generator never sees half a file); ``prune_versions`` keeps only the
newest few. ``asyncrl.weights.file`` announces each version.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


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


def prune_versions(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` version folders under ``root``."""
    versions = sorted(p for p in root.glob("v*") if p.is_dir())
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
