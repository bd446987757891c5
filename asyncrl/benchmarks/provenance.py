"""Which code a benchmark measured: the commit its figures name."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measured_commit(root: Path = ROOT) -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it (untracked ones do not count)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()

    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
