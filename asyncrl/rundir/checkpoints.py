"""Checkpoints of a whole run: written in parts, committed atomically, verified before use.

A checkpoint is ``RUN_DIR/checkpoints/v{version:08d}/`` holding one folder per part and a
``manifest.json``:

- ``learner/``: the DeepSpeed checkpoint (weights and optimizer; the critic's too), the version,
  counters, RNG states, and the ids of the groups trained so far (exactly-once after a resume);
- ``buffer/``: the replay buffer's snapshot (items, priorities, sampler RNG, counters) and
  ``buffer_ids.json``, the groups it held;
- ``dispatcher.json``: the prompt cursor, the admission counters, and every group dispatched and
  not settled by this checkpoint (in flight, in a reward worker, in the buffer, or trained after
  ``version``), to be dispatched again on resume unless the buffer part holds it.

The parts are taken in this order — learner at ``version``, then buffer, then dispatcher — so
each later part sees everything the earlier ones hold: a group is in the learner's trained set,
the buffer's snapshot, or the dispatcher's list (or more than one: ids make the copies harmless).

Commit: the parts are written into ``.tmp-v{version}``; the controller then writes the manifest
(every file's size and SHA-256), fsyncs every file and the folder, renames the folder to its
final name (one ``rename``: a crash leaves the whole checkpoint or none), points
``checkpoints/latest`` at it (written beside and renamed too), and removes the oldest beyond
``checkpoint.keep_last``. ``latest_checkpoint`` returns the newest one whose manifest verifies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from pydantic import Field

from asyncrl.configbase import Config

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointConfig(Config):
    every_steps: int = Field(50, ge=0)
    """Checkpoint the run every this many learner steps (0: never; a resume then starts over)."""
    keep_last: int = Field(2, ge=1)
    """Committed checkpoints kept; older ones are removed once a newer one is committed."""
    timeout_s: float = Field(120.0, gt=0)
    """Seconds the buffer and the dispatcher have to write their parts before the checkpoint is
    abandoned (logged; training goes on and the next one is tried)."""
    ledger_segment_mb: float = Field(16.0, gt=0)
    """Each process's ledger file is closed past this size and a new one begun; at each committed
    checkpoint the closed ones are compacted into ``ledger/compacted.bin`` (groups settled as bits,
    ``asyncrl.rundir.ledger_replay``), so a long run's ledger stays small. Without checkpoints
    nothing is compacted."""

    @property
    def ledger_segment_bytes(self) -> int:
        return int(self.ledger_segment_mb * (1 << 20))


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def name_of(version: int) -> str:
    return f"v{version:08d}"


def staging_dir(run_dir: Path, version: int) -> Path:
    """Where the parts of the checkpoint of ``version`` are written before the commit."""
    return checkpoints_dir(run_dir) / f".tmp-{name_of(version)}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


HASH_BLOCK = 1 << 18
"""Bytes read at a time to hash a checkpoint's file, into one buffer reused for every file of a
commit (``f.read`` allocates a fresh block per read)."""


def _sha256(path: Path, buf: bytearray | None = None) -> str:
    h = hashlib.sha256()
    view = memoryview(buf if buf is not None else bytearray(HASH_BLOCK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def commit(run_dir: Path, version: int, parts: list[str], meta: dict | None = None, keep_last: int = 2) -> Path:
    """Seal the staged checkpoint of ``version``: manifest, fsync, rename, ``latest``, prune."""
    stage = staging_dir(run_dir, version)
    missing = [p for p in parts if not (stage / p).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {name_of(version)} lacks part(s) {missing} in {stage}")
    files, buf = {}, bytearray(HASH_BLOCK)
    for path in _files(stage):
        _fsync(path)
        files[str(path.relative_to(stage))] = {"bytes": path.stat().st_size, "sha256": _sha256(path, buf)}
    manifest = {
        "format": FORMAT,
        "version": version,
        "parts": parts,
        "created": time.time(),
        "files": files,
        **(meta or {}),
    }
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(stage / MANIFEST)
    for folder in sorted({p.parent for p in _files(stage)} | {stage}, key=lambda p: -len(p.parts)):
        _fsync(folder)
    final = checkpoints_dir(run_dir) / name_of(version)
    if final.exists():
        shutil.rmtree(final)  # a checkpoint of this version from a history a restore rolled back
    os.rename(stage, final)
    latest_tmp = checkpoints_dir(run_dir) / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, checkpoints_dir(run_dir) / "latest")
    _fsync(checkpoints_dir(run_dir))
    for old in committed(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def committed(run_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first (by version)."""
    root = checkpoints_dir(run_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and (p / MANIFEST).exists())


def verify(path: Path) -> dict:
    """The manifest of checkpoint ``path`` after checking every file's size and SHA-256."""
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {manifest.get('format')!r} is not {FORMAT}")
    buf = bytearray(HASH_BLOCK)
    for rel, want in manifest["files"].items():
        f = path / rel
        if not f.exists():
            raise ValueError(f"{path}: file {rel} of the manifest is missing")
        if f.stat().st_size != want["bytes"] or _sha256(f, buf) != want["sha256"]:
            raise ValueError(f"{path}: file {rel} does not match its checksum in the manifest")
    return manifest


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest committed checkpoint that verifies (a damaged one is logged and skipped)."""
    for path in reversed(committed(run_dir)):
        try:
            verify(path)
            return path
        except (ValueError, OSError, json.JSONDecodeError) as e:
            log.error("skipping checkpoint %s: %s", path, e)
    return None


def discard_staging(run_dir: Path) -> None:
    """Remove parts of checkpoints that were never committed (a crash in the middle of one)."""
    root = checkpoints_dir(run_dir)
    if root.exists():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
