"""Read-only mappings of shared-memory weight files, kept while the learner reuses the files.

The learner writes each version into the files of the version before last (``ShmWeightPublisher``
recycles them: same inodes, pages already allocated). A mapping shows what its file holds now,
whatever the file is called by then, so a reader that keeps its mapping of a file reads the next
version through page tables it has already filled. A fresh mapping faults on every page it
reads: 64 MiB read through one took ~7 ms here, through a kept one ~4 ms.

Files are told apart by (device, inode). While a mapping exists its inode stays allocated, so
that pair cannot name another file meanwhile. A mapping is released once none of the last
``keep`` versions used its file. Until then the pages of a file the learner has since removed
stay allocated: at most ``keep`` versions' worth on top of what the learner keeps. A mapping
that tensors still point into lives on until they are gone (dropping it here only lets it go).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path


class MappingCache:
    """``map`` a file of a version (reusing this process's mapping of the same file), then
    ``settle`` the version once all its files are mapped. Not thread-safe: one thread maps."""

    def __init__(self, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be >= 1")
        self.keep = keep
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._used: dict[int, set[tuple[int, int]]] = {}  # version -> files it mapped
        self._settled: list[int] = []
        self.reused = 0
        """Mappings handed out again (their page tables already filled), for tests and metrics."""

    def map(self, path: str | Path, nbytes: int, version: int) -> mmap.mmap:
        """A shared, read-only mapping of the first ``nbytes`` of ``path`` (FileNotFoundError
        when it is gone)."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino)
            self._used.setdefault(version, set()).add(key)
            mm = self._maps.get(key)
            if mm is not None and len(mm) == nbytes:
                self.reused += 1
                return mm
            # Not populated (no MAP_POPULATE): a reader whose peer checks the bucket touches its
            # pages only when its engine copies them in.
            mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self._maps[key] = mm
            return mm

    def settle(self, version: int) -> None:
        """``version`` is whole: release the mappings that neither it, the ``keep - 1`` versions
        settled before it, nor a newer version being mapped uses."""
        self._settled = sorted({*self._settled, version})[-self.keep :]
        kept = set(self._settled) | {v for v in self._used if v > version}
        for v in [v for v in self._used if v not in kept]:
            del self._used[v]
        live = set().union(*self._used.values())
        for key in [k for k in self._maps if k not in live]:
            del self._maps[key]

    def clear(self) -> None:
        self._maps.clear()
        self._used.clear()
        self._settled.clear()

    def __len__(self) -> int:
        return len(self._maps)
