"""The learner's side of the shared-memory weight broadcast: write each version into ``/dev/shm``,
announce it, unlink or recycle what every subscriber is done with (``asyncrl.weights.shm`` says how
the transport works, and why).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from asyncrl.weights.announcer import VersionAnnouncer
from asyncrl.weights.buckets import HASHES, checksum, layout, pack_tensor, specs_to_wire, zero_padding
from asyncrl.wire.sockets import StreamReceiver

log = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"


def remove_stale(root: Path) -> None:
    """Remove the directories of publishers that are gone (killed by SIGKILL: nothing else leaves
    them behind), so that shared memory does not fill up across runs. A live publisher holds an
    exclusive ``flock`` on its directory's ``.lock`` (valid across PID namespaces sharing /dev/shm)."""
    for folder in root.glob("asyncrl-weights-*-*"):
        try:
            fd = os.open(folder / ".lock", os.O_RDWR)
        except FileNotFoundError:
            continue  # not ours, or being created
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its publisher is alive
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


class ShmWeightPublisher:
    """Writes versions into shared memory, bucket by bucket, and announces the newest.

    On the learner, with its model (tests/weights/test_transports.py runs it)::

        pub = ShmWeightPublisher("tcp://127.0.0.1:0")
        pub.publish(state_dict_buckets(model.state_dict(), 64 << 20), version=1)
    """

    transport = "shm"

    def __init__(
        self,
        address: str,
        name: str = "learner.weights",
        root: str | Path = SHM_ROOT,
        keep_s: float = 60.0,
        max_versions: int = 3,
        hash: str = "sum64",
    ):
        if keep_s <= 0:
            raise ValueError(f"keep_s ({keep_s}) must be > 0")
        if max_versions < 2:
            raise ValueError(f"max_versions ({max_versions}) must be >= 2 (the newest and one being read)")
        if hash not in HASHES:
            raise ValueError(f"hash ({hash!r}) must be one of {HASHES}")
        self.name = name
        self.hash = hash
        self.keep_s = keep_s
        self.max_versions = max_versions
        remove_stale(Path(root))
        self.dir = Path(root) / f"asyncrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True)
        self._lock = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this publisher lives
        # Removed at close(), or when this object is collected or the interpreter exits (an
        # exception, a failed test): shared memory must not outlive the learner. Only a SIGKILL
        # leaves it behind (``/dev/shm/asyncrl-weights-PID-*``): the next publisher removes it.
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.announcer = VersionAnnouncer(address, name=name)
        self.address = self.announcer.address
        self.acks = StreamReceiver("tcp://127.0.0.1:0", name=f"{name}.acks", bind=True)
        self.versions: dict[int, float | None] = {}  # version -> time superseded (None: newest)
        self.acked: dict[str, int] = {}  # subscriber -> newest version it acked
        self.errors: list[dict] = []  # error reports from subscribers, newest last
        self._free: list[Path] = []  # directories of versions every subscriber is done with
        self._recycled: Path | None = None
        self._maps: dict[Path, dict[str, mmap.mmap]] = {}  # version directory -> its files' mappings
        self._summer = ThreadPoolExecutor(1, thread_name_prefix=f"{name}.checksum")

    def publish(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, meta: dict | None = None
    ) -> dict:
        """Write every bucket (consumed one at a time), announce; returns {bytes, buckets, seconds}."""
        start = time.perf_counter()
        self.poll()  # acks that arrived since: a version everyone is done with can be recycled now
        final = self.dir / f"v{version:06d}"
        tmp = self.dir / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        new_maps: dict[str, mmap.mmap] = {}
        if self._free:  # reuse the files of a version nobody needs: pages allocated, mappings kept
            self._recycled = self._free.pop()
            os.replace(self._recycled, tmp)
        else:
            tmp.mkdir()
        maps = self._maps.pop(self._recycled, {}) if self._recycled is not None else {}
        self._recycled = None
        for verdict in tmp.glob("*.check"):  # a recycled version's: they name another version anyway
            verdict.unlink()
        entries, sums, total, announced = [], [], 0, 0
        for index, named in enumerate(buckets):
            specs, size = layout(named)
            size = max(size, 1)
            fname = f"b{index:05d}"
            mm = maps.pop(fname, None)
            if mm is None or len(mm) != size:
                if mm is not None:
                    mm.close()
                mm = self._map(tmp / fname, size)
            new_maps[fname] = mm
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            view = memoryview(mm)
            parts = []
            # Each tensor is summed on a second thread while the next one is copied (both
            # release the GIL); sum64 adds up per tensor (each starts 8-aligned, padding is 0).
            for (_, t), spec in zip(named, specs):
                pack_tensor(dst, t, spec)
                if self.hash == "sum64":
                    part = view[spec.offset : spec.offset + spec.nbytes]
                    parts.append(self._summer.submit(checksum, part, self.hash))
            zero_padding(dst, specs)
            if self.hash != "sum64":
                parts.append(self._summer.submit(checksum, view, self.hash))
            sums.append(parts)
            del dst, view
            entries.append({"file": fname, "nbytes": size, "hash": self.hash, "tensors": specs_to_wire(specs)})
            total += size
            announced = self._announce_parts(version, tmp, entries, sums, announced)
        for entry, parts in zip(entries, sums):
            entry["crc"] = sum(p.result() for p in parts) & 0xFFFFFFFFFFFFFFFF
        for mm in maps.values():  # files of a recycled version beyond this one's buckets
            mm.close()
        for extra in tmp.glob("b*"):
            if extra.suffix != ".check" and extra.name not in new_maps:
                extra.unlink()
        if final.exists():
            self._close_maps(final)
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._maps[final] = new_maps
        now = time.monotonic()
        for v, superseded in self.versions.items():
            if superseded is None:
                self.versions[v] = now
        self.versions[version] = None
        self.announcer.set(
            {
                "policy_version": version,
                "transport": self.transport,
                "dir": str(final),
                "buckets": entries,
                "ack": self.acks.address,
                **(meta or {}),
            }
        )
        self.poll()
        return {"bytes": total, "buckets": len(entries), "seconds": time.perf_counter() - start}

    def _announce_parts(self, version: int, folder: Path, entries: list, sums: list, announced: int) -> int:
        """Announce each bucket written and summed since the last call (subscribers check it while
        the next ones are written); returns how many are announced."""
        while announced < len(entries) and all(p.done() for p in sums[announced]):
            entry = entries[announced]
            entry["crc"] = sum(p.result() for p in sums[announced]) & 0xFFFFFFFFFFFFFFFF
            self.announcer.send_once(
                {"policy_version": version, "part": announced, "dir": str(folder), "bucket": entry}
            )
            announced += 1
        return announced

    @staticmethod
    def _map(path: Path, size: int) -> mmap.mmap:
        """A shared, writable mapping of ``path`` sized ``size`` (a new tmpfs file, or a recycled one resized)."""
        with open(path, "r+b" if path.exists() else "w+b") as f:
            if os.fstat(f.fileno()).st_size != size:
                f.truncate(size)
            return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)

    def _close_maps(self, folder: Path) -> None:
        for mm in self._maps.pop(folder, {}).values():
            mm.close()

    def announce(self, force: bool = False) -> None:
        """Repeat the newest announcement (at most once a second unless forced); collect acks."""
        self.announcer.announce(force)
        self.poll()

    def poll(self) -> None:
        """Take the acks that arrived, then unlink the versions nobody needs any more."""
        while (msg := self.acks.recv(0)) is not None:
            kind, body = msg
            if kind == "weights_ack":
                sub, v = body.subscriber, body.policy_version
                self.acked[sub] = max(v, self.acked.get(sub, -1))
            elif kind == "weights_error":
                self.errors.append(body)
                log.error(
                    "%s: %s failed to apply version %s: %s",
                    self.name,
                    body.subscriber,
                    body.policy_version,
                    body.error,
                )
        self._prune()

    def _prune(self) -> None:
        now = time.monotonic()
        old = sorted(v for v, t in self.versions.items() if t is not None)
        for i, v in enumerate(old):
            everyone = bool(self.acked) and all(a >= v for a in self.acked.values())
            expired = now - self.versions[v] > self.keep_s
            too_many = len(self.versions) - i > self.max_versions
            if everyone or expired or too_many:
                if too_many and not (everyone or expired):
                    log.warning(
                        "%s: removing version %d before every subscriber acked it (%d versions kept at most)",
                        self.name,
                        v,
                        self.max_versions,
                    )
                folder = self.dir / f"v{v:06d}"
                if everyone and not self._free:
                    # Every subscriber has copied it out: its files (and our mappings of them,
                    # written again without a page fault) can take the next version.
                    os.replace(folder, self.dir / f".free-{v:06d}")
                    self._free.append(self.dir / f".free-{v:06d}")
                    self._maps[self._free[-1]] = self._maps.pop(folder, {})
                else:  # unlinked: a subscriber still mapping it keeps its pages until it unmaps
                    self._close_maps(folder)
                    shutil.rmtree(folder, ignore_errors=True)
                del self.versions[v]

    def close(self) -> None:
        self._summer.shutdown(wait=True)
        for folder in list(self._maps):
            self._close_maps(folder)
        self.announcer.close()
        self.acks.close()
        self._cleanup()
        os.close(self._lock)
