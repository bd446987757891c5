"""Each bucket in shared memory checked once per host, by whichever subscriber locks it first.

The bytes of a version are one copy on the host (``asyncrl.weights.shm``), so reading every byte
in each of N subscribers would make the check time grow with N. The first subscriber to take the
lock on ``FILE.check`` (``flock``, exclusive) reads the bucket and writes its verdict there
(``VERSION CRC ok``, or ``bad`` and the reason); the others skip to the next bucket and read the
verdict when they need it. The kernel drops the lock of a subscriber that dies, so the next one to
take it finds no verdict and checks the bucket itself; one that takes longer than
``CHECK_WAIT_S`` is not waited for (the waiter checks too). A ``bad`` verdict fails every
subscriber, as its own check would.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time
from pathlib import Path

from asyncrl.weights.buckets import verify
from asyncrl.weights.update import WeightSyncError

log = logging.getLogger(__name__)

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
