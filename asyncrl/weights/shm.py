"""Same-host weight broadcast through shared memory, announced over ZeroMQ.

The learner writes each bucket once into its own file under ``/dev/shm`` (a tmpfs: pages of
RAM, no disk), in a directory per version that is renamed into place when complete, so a
subscriber never sees half a version. It then announces ``{policy_version, dir, buckets:
[{file, nbytes, crc, tensors: [[name, dtype, shape, offset, nbytes]...]}], ack}`` on a PUB
socket, and repeats the newest announcement every second (a PUB drops what was sent before a
subscriber joined). Each subscriber maps the files (``mmap``, shared and read-only: torch
views, no copy) and hands out views once every bucket's checksum is checked: the data is written
once whatever the number of subscribers, which is why the time stays flat as they grow. It keeps
its mapping of each file while recent versions use it (``asyncrl.weights.mappings``): a recycled
file (below) is read again without page faults.

The bytes are one copy on the host, so each bucket is checked once per host, not once per
subscriber (N subscribers reading every byte would make the time grow with N): the first
subscriber to take the lock on ``FILE.check`` (``flock``, exclusive) reads the bucket and writes
its verdict there (``VERSION CRC ok``, or ``bad`` and the reason); the others skip to the next
bucket and read the verdict when they need it. The kernel drops the lock of a subscriber that
dies, so the next one to take it finds no verdict and checks the bucket itself; one that takes
longer than ``CHECK_WAIT_S`` is not waited for (the waiter checks too). A ``bad`` verdict fails
every subscriber, as its own check would.

To overlap the subscribers' checks with the writing, each bucket is also announced as soon as it
is written and summed (``{policy_version, part, dir, bucket}``, pointing into the version's
temporary directory): a subscriber's checker thread maps and checks it then, and once the
version is announced whole it maps only the buckets it has not seen (a mapping survives the
rename). ``newest`` hands out versions already verified, so the checks run while a generator
samples, off its critical path.

Unlinking: each subscriber acks a version (PUSH to the learner's PULL, address in the
announcement) once its engine has copied the tensors in, or reports the error. A superseded
version is removed once every subscriber that has ever acked has acked it or a newer one, or
``keep_s`` seconds after it was superseded, and in any case when more than ``max_versions``
exist. A version every subscriber acked is not unlinked but recycled: its files take the next
version (their tmpfs pages are already allocated, which makes writing ~2x faster). A mapping
survives the unlink (Linux keeps the pages until the last ``munmap``), so
removal only races a subscriber that has not opened the files yet; it then gets a
``WeightSyncError`` naming the missing version and takes the next one.

| socket | blocks | dropped |
| --- | --- | --- |
| announcements PUB -> SUB | never | everything before a subscriber joins (hence the repeats) |
| acks PUSH -> PULL | a subscriber's ack waits up to 1 s for the learner, then is dropped (logged) | nothing else |
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import shutil
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import zmq

from asyncrl.weights.announcer import VersionAnnouncer
from asyncrl.weights.buckets import (
    HASHES,
    checksum,
    layout,
    pack_tensor,
    specs_from_wire,
    specs_to_wire,
    unpack,
    verify,
    zero_padding,
)
from asyncrl.weights.mappings import MappingCache
from asyncrl.weights.update import WeightSyncError, WeightUpdate
from asyncrl.wire.messages import WeightsAck, WeightsAnnouncement, WeightsError
from asyncrl.wire.sockets import StreamReceiver, StreamSender, Subscriber

log = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"
CHECK_WAIT_S = 10.0  # how long a subscriber waits for a peer's verdict on a bucket before checking it itself


class SharedCheck:
    """One bucket's checksum, checked once on this host by whichever subscriber locks it first.

    ``attempt`` never blocks: it checks the bucket when no peer is at it (or reads a verdict
    already there) and returns True, else False. ``finish`` waits for the peer's verdict (at most
    ``CHECK_WAIT_S``), or checks the bucket itself. Both raise ``WeightSyncError`` on a bad
    verdict. Where the verdict file cannot be written (another user's directory), every
    subscriber checks for itself."""

    def __init__(self, path: Path, mm: mmap.mmap, entry: dict, version: int, what: str):
        self.path, self.mm, self.version, self.what = path.with_name(path.name + ".check"), mm, version, what
        self.crc, self.algo = int(entry["crc"]), entry.get("hash", "crc32")
        self.done = False

    def moved_to(self, folder: Path) -> SharedCheck:
        """The same check, its verdict file now in ``folder`` (the version was renamed into place)."""
        self.path = folder / self.path.name
        return self

    def attempt(self) -> bool:
        if not self.done:
            self._under_lock(fcntl.LOCK_EX | fcntl.LOCK_NB)
        return self.done

    def finish(self) -> None:
        deadline = time.monotonic() + CHECK_WAIT_S
        while not self.attempt():
            if time.monotonic() > deadline:
                log.warning(
                    "%s: no verdict from the subscriber checking it after %.0f s; checking it here",
                    self.what,
                    CHECK_WAIT_S,
                )
                self._check()
                return
            time.sleep(0.002)

    def _under_lock(self, how: int) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            return  # the version's directory was renamed into place: ``fetch`` moves us along
        except OSError:  # not ours to write: no sharing
            self._check()
            return
        try:
            try:
                fcntl.flock(fd, how)
            except BlockingIOError:
                return  # a peer is checking it
            verdict = os.pread(fd, 4096, 0).decode(errors="replace").split(" ", 3)
            if verdict[:2] == [str(self.version), str(self.crc)] and len(verdict) >= 3:
                if verdict[2] != "ok":
                    reason = verdict[3] if len(verdict) > 3 else "failed its check"
                    raise WeightSyncError(f"{self.what}: {reason} (checked by another subscriber on this host)")
                self.done = True
                return
            try:
                self._check()
                result = "ok"
            except WeightSyncError as e:
                result = f"bad {str(e).removeprefix(self.what + ': ')}"
                raise
            finally:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{self.version} {self.crc} {result}".encode(), 0)
        finally:
            os.close(fd)  # releases the lock

    def _check(self) -> None:
        verify(self.mm, self.crc, self.what, self.algo)
        self.done = True


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

    >>> pub = ShmWeightPublisher("tcp://127.0.0.1:0")  # doctest: +SKIP
    >>> pub.publish(state_dict_buckets(model.state_dict(), 64 << 20), version=1)  # doctest: +SKIP
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


class ShmWeightSubscriber:
    """Maps announced versions from shared memory, verifies them, and acks them when done.

    A background thread owns the SUB socket: it checks each bucket as it is announced and each
    version as it completes, so ``newest`` hands out a version already verified, and the
    checks run while the generator samples. A failed check is raised by the next ``newest``."""

    transport = "shm"

    def __init__(self, address: str, name: str = "generator.weights"):
        self.name = name
        self.sub = Subscriber(address, name=name)  # the checker thread's alone (ZeroMQ sockets are not thread-safe)
        self._ack: StreamSender | None = None
        self._ack_lock = threading.Lock()
        # version -> file -> (map, entry, its check), for buckets announced early
        self._parts: dict[int, dict[str, tuple[mmap.mmap, dict, SharedCheck]]] = {}
        self._maps = MappingCache()  # the checker thread's alone, as is every mapping
        self._cond = threading.Condition()
        self._ready: WeightUpdate | None = None  # the newest version verified and not handed out yet
        self._error: BaseException | None = None
        self._taken = -1  # newest version verified (or being handed out): repeats of it are ignored
        self._served = -1  # newest version the caller said it serves
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}.check", daemon=True)
        self._thread.start()

    def newest(self, served_version: int, timeout: float = 0.0) -> WeightUpdate | None:
        """The newest announced version above ``served_version``, mapped and verified, or None.

        Waits up to ``timeout`` seconds for one (0: only what is ready); raises what the checks met."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._served = max(self._served, served_version)
            while self._error is None and not self._has_newer(served_version):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if not self._has_newer(served_version):
                return None
            update, self._ready = self._ready, None
            return update

    def _has_newer(self, served_version: int) -> bool:
        return self._ready is not None and self._ready.version > served_version

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self.sub.recv(0.05)
            if msg is None or msg[0] != "weights":
                continue
            body = msg[1]
            version = body.policy_version
            if version <= max(self._taken, self._served):
                continue  # a repeat, or older than what is served
            try:
                if body.part is not None:
                    self._take_part(body)
                    continue
                announced_at = time.monotonic()
                update = self.fetch(body)
                update.announced_at = announced_at
            except Exception as e:  # raised by the caller's next newest(): never swallowed
                log.error("%s: %s", self.name, e)
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                continue
            with self._cond:
                self._taken = version
                superseded, self._ready = self._ready, update
                self._cond.notify_all()
            if superseded is not None:
                superseded.done()  # never applied, no longer needed: the learner may reuse it

    def _take_part(self, body: WeightsAnnouncement) -> None:
        """Map and check one bucket of a version still being written (announced early); ``fetch``
        then only maps the buckets it has not seen. A part gone already is left to ``fetch``."""
        version, entry = body.policy_version, body.bucket
        for old in [v for v in self._parts if v < version]:
            del self._parts[old]
        path = Path(body.dir) / entry["file"]
        try:
            mm = self._map(path, int(entry["nbytes"]), version)
        except WeightSyncError:
            return
        check = SharedCheck(path, mm, entry, version, f"{self.name}: version {version} bucket {entry['file']}")
        parts = self._parts.setdefault(version, {})
        parts[entry["file"]] = (mm, entry, check)
        for _, _, pending in parts.values():  # this one, and those a peer was checking last time
            pending.attempt()

    def _map(self, path: Path, nbytes: int, version: int) -> mmap.mmap:
        """Shared and read-only: nothing is copied. The mapping of a recycled file is kept from
        one version to the next (``MappingCache``: no page faults when reading it again)."""
        try:
            return self._maps.map(path, nbytes, version)
        except FileNotFoundError:
            raise WeightSyncError(
                f"{self.name}: version {version} is gone from shared memory ({path}): a newer one replaced it"
            ) from None

    def fetch(self, body: WeightsAnnouncement) -> WeightUpdate:
        """Map and verify the version that ``body`` announces."""
        start = time.perf_counter()
        version = body.policy_version
        folder = Path(body.dir)
        tensors, total, checks = [], 0, []
        early = self._parts.pop(version, {})
        for b in body.buckets:
            mm, seen, check = early.get(b["file"], (None, None, None))
            if seen is None or seen["crc"] != b["crc"] or seen["nbytes"] != b["nbytes"]:
                mm = self._map(folder / b["file"], int(b["nbytes"]), version)
                check = SharedCheck(
                    folder / b["file"], mm, b, version, f"{self.name}: version {version} bucket {b['file']}"
                )
                check.attempt()  # those a peer is checking are left for the end
            checks.append(check.moved_to(folder))
            with warnings.catch_warnings():  # read-only views: the engine only copies from them
                warnings.simplefilter("ignore", UserWarning)
                tensors.extend(unpack(mm, specs_from_wire(b["tensors"])))
            total += int(b["nbytes"])
        for check in checks:
            check.finish()
        self._maps.settle(version)
        meta = {
            k: v for k, v in body.as_dict().items() if k not in ("dir", "buckets", "ack", "transport", "policy_version")
        }
        update = WeightUpdate(version, tensors, meta, total, time.perf_counter() - start)
        update.shm = [
            {"path": str(folder / b["file"]), "nbytes": int(b["nbytes"]), "tensors": b["tensors"]} for b in body.buckets
        ]
        update._on_done = lambda error: self._report(body.ack, version, error)
        return update

    def _report(self, address: str | None, version: int, error: str | None) -> None:
        if address is None:
            return
        with self._ack_lock:  # done() runs on the caller's thread and, for superseded versions, on ours
            self._send_report(address, version, error)

    def _send_report(self, address: str, version: int, error: str | None) -> None:
        if self._ack is None or self._ack.address != address:
            if self._ack is not None:
                self._ack.close()
            self._ack = StreamSender(address, name=f"{self.name}.ack")
            self._ack.sock.setsockopt(zmq.LINGER, 1000)  # a gone learner must not hold up close()
        report = (WeightsAck if error is None else WeightsError)(
            subscriber=self.name, policy_version=version, error=error
        )
        kind = report.kind
        try:
            self._ack.send(report, timeout=1.0)
        except TimeoutError:
            log.warning("%s: the learner took no %s for version %d within 1 s; dropped", self.name, kind, version)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._maps.clear()
        self.sub.close()
        with self._ack_lock:
            if self._ack is not None:
                self._ack.close()
