"""The generators' side of the shared-memory weight broadcast: map each announced version, check
it (once per host, ``asyncrl.weights.shm_check``), hand it out, ack it (``asyncrl.weights.shm``
says how the transport works, and why).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
import warnings
from pathlib import Path

import zmq

from asyncrl.weights.buckets import specs_from_wire, unpack
from asyncrl.weights.mappings import MappingCache
from asyncrl.weights.shm_check import SharedCheck
from asyncrl.weights.update import WeightSyncError, WeightUpdate
from asyncrl.wire.messages import WeightsAck, WeightsAnnouncement, WeightsError
from asyncrl.wire.sockets import StreamSender, Subscriber

log = logging.getLogger(__name__)


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
