"""Snapshots of a replay buffer: its whole state in a directory, written atomically.

``save_buffer(buf, path)`` / ``restore_buffer(buf, path)`` (``ReplayBuffer.snapshot`` and
``.restore``): stored items with their metadata in arrival order, payloads (groups as ``wire``
frames, so a restore validates them like any received group; slab records as arrays), the
sampler's leaves and RNG state, the rate limiter's counters and every ledger counter (the
zero-variance filter's among them). The
staleness buckets, free slots and arrival ring are rebuilt from the items. Restored into a
buffer built with the same config, the next samples are those the original would have drawn.


``write_snapshot(path, arrays, header, blobs)`` writes every file into a fresh sibling temporary
directory, fsyncs each file and the directory, then renames the directory to ``path`` (one
``rename``: a reader, or a restart after a crash, sees either the complete snapshot or none).
``path`` must not exist: a checkpoint is a new directory per step, never an overwrite, so there
is no moment at which neither the old nor the new copy is whole.

Layout: ``arrays.npz`` (uncompressed: the bulk is token ids, compression buys little and costs
seconds), ``header.json`` (scalars, RNG states, counters), ``<name>.bin`` per blob.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np

from asyncrl import wire
from asyncrl.buffer.storage import GroupStorage
from asyncrl.wire.codec import upgrade

FORMAT = 1
_COUNTERS = ("inserted", "sampled", "resampled", "dropped", "removed")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(
    path: str | Path, arrays: dict[str, np.ndarray], header: dict, blobs: dict[str, bytes] | None = None
) -> Path:
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"snapshot directory {path} exists; a snapshot is written to a new directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with open(tmp / "arrays.npz", "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        for name, data in (blobs or {}).items():
            with open(tmp / f"{name}.bin", "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        with open(tmp / "header.json", "w") as f:
            json.dump({"format": FORMAT, **header}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        os.rename(tmp, path)
        _fsync_path(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_snapshot(
    path: str | Path, blob_names: tuple[str, ...] = ()
) -> tuple[dict[str, np.ndarray], dict, dict[str, bytes]]:
    """(arrays, header, blobs) of a snapshot written by ``write_snapshot``."""
    path = Path(path)
    if not (path / "header.json").exists():
        raise FileNotFoundError(f"{path} is not a snapshot: it has no header.json")
    header = json.loads((path / "header.json").read_text())
    if header.get("format") != FORMAT:
        raise ValueError(f"snapshot format ({header.get('format')!r}) must be {FORMAT}")
    with np.load(path / "arrays.npz", allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    blobs = {name: (path / f"{name}.bin").read_bytes() for name in blob_names}
    return arrays, header, blobs


def save_buffer(buf, path) -> None:
    storage = buf.storage
    st = storage.state()
    payload = storage.payload_state(st["slots"])
    arrays = {f"storage.{k}": v for k, v in st.items()}
    blobs = {}
    if isinstance(payload, list):  # Group objects
        blobs["groups"] = msgpack.packb([wire.encode_group(g) for g in payload], use_bin_type=True)
    else:
        arrays.update({f"payload.{k}": v for k, v in payload.items()})
    sampler_state = buf.sampler.state()
    if "leaves" in sampler_state:
        arrays["sampler.leaves"] = sampler_state.pop("leaves")
    header = {
        "storage": type(storage).__name__,
        "max_items": storage.max_items,
        "sampler": type(buf.sampler).__name__,
        "sampler_state": sampler_state,
        "rate_limiter": buf.rate_limiter.state(),
        "learner_version": buf.learner_version,
        "dropped_groups": buf.dropped_groups,
        "priority_updates_ignored": buf.priority_updates_ignored,
        **{name: dict(getattr(buf, name)) for name in _COUNTERS},
    }
    if getattr(buf, "zero_variance", None) is not None:
        header["zero_variance"] = buf.zero_variance.state()
    write_snapshot(path, arrays, header, blobs)


def restore_buffer(buf, path) -> None:
    storage = buf.storage
    if len(storage) or buf.inserted:
        raise ValueError("restore needs a fresh buffer; this one has already taken inserts")
    is_groups = isinstance(storage, GroupStorage)
    arrays, header, blobs = read_snapshot(path, ("groups",) if is_groups else ())
    for key, mine in (
        ("storage", type(storage).__name__),
        ("max_items", storage.max_items),
        ("sampler", type(buf.sampler).__name__),
    ):
        if header[key] != mine:
            raise ValueError(f"snapshot {key} ({header[key]!r}) differs from this buffer's ({mine!r})")
    part = {
        prefix: {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith(prefix + ".")}
        for prefix in ("storage", "payload")
    }
    slots = storage.load_state(part["storage"])
    if is_groups:
        frames = msgpack.unpackb(blobs["groups"], raw=False)
        # a snapshot of an older schema's groups is upgraded to this one (``asyncrl.wire.codec.upgrade``)
        storage.load_payload(slots, [wire.decode(upgrade(frame))[1].group for frame in frames])
    else:
        storage.load_payload(slots, part["payload"])
    sampler_state = dict(header["sampler_state"])
    if "sampler.leaves" in arrays:
        sampler_state["leaves"] = arrays["sampler.leaves"]
    buf.sampler.load_state(sampler_state)
    buf.rate_limiter.load_state(header["rate_limiter"])
    buf.learner_version = int(header["learner_version"])
    buf.dropped_groups = int(header["dropped_groups"])
    buf.priority_updates_ignored = int(header["priority_updates_ignored"])
    for name in _COUNTERS:
        setattr(buf, name, Counter(header[name]))
    if getattr(buf, "zero_variance", None) is not None and "zero_variance" in header:
        buf.zero_variance.load_state(header["zero_variance"])
    buf.staleness.rebuild(storage)
