import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.observability.procmem import (
    MemoryWatch,
    descendants,
    peak_rss_bytes,
    tree_peak_rss_bytes,
    tree_rss_bytes,
)


def own_rss_bytes() -> int:
    """This process's current RSS alone (tree_rss_bytes adds any children a test left running)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return 1024 * int(line.split()[1])
    raise AssertionError("no VmRSS line in /proc/self/status")


def test_peak_rss_holds_what_the_process_touched():
    before = own_rss_bytes()
    # 64 MiB of fresh anonymous pages, written so that they are resident: a mapping of its own, not
    # malloc's, whose arenas may hold pages a test before this one freed and left resident
    block = mmap.mmap(-1, 64 << 20)
    try:
        for offset in range(0, len(block), mmap.PAGESIZE):
            block[offset] = 1
        now = own_rss_bytes()
        assert now >= before + (60 << 20)
        assert peak_rss_bytes() >= now  # the high-water mark is at least where we are
        assert tree_rss_bytes(os.getpid()) >= now
    finally:
        block.close()


def test_tree_counts_a_live_child_and_its_peak():
    # The child touches 80 MiB, frees it, says so, then waits: its current RSS falls, its peak stays.
    code = (
        "import sys; b = bytearray(80 << 20); b[::4096] = b'x' * len(b[::4096]); del b; "
        "print('freed', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"freed"
        assert child.pid in descendants(os.getpid())
        assert peak_rss_bytes(child.pid) > 80 << 20
        assert tree_peak_rss_bytes() >= peak_rss_bytes() + peak_rss_bytes(child.pid)
        assert tree_rss_bytes(child.pid) < peak_rss_bytes(child.pid) - (60 << 20)
    finally:
        child.communicate(b"")
    assert tree_rss_bytes(child.pid) is None  # gone


def test_memory_watch_keeps_the_peak_total_and_the_lowest_available():
    # A fresh child touches 80 MiB on cue: a long-lived interpreter (the suite's) may serve a new
    # block from pages it already holds, so its own RSS need not grow.
    code = (
        "import sys; print('ready', flush=True); sys.stdin.readline(); "
        "b = bytearray(80 << 20); b[::4096] = b'x' * len(b[::4096]); print('touched', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        clock = [0.0]
        watch = MemoryWatch(every_s=1.0, clock=lambda: clock[0])
        watch.sample({"child": child.pid})
        first = watch.summary()
        assert first["peak_rss_total_bytes"] >= first["rss_at_peak_bytes"]["child"] > 0
        assert first["min_mem_available_bytes"] > 0
        child.stdin.write(b"go\n"), child.stdin.flush()
        assert child.stdout.readline().strip() == b"touched"
        watch.sample({"child": child.pid})  # within every_s: not sampled
        assert watch.summary()["peak_rss_total_bytes"] == first["peak_rss_total_bytes"]
        clock[0] = 1.5
        watch.sample({"child": child.pid})
        assert watch.summary()["peak_rss_total_bytes"] >= first["peak_rss_total_bytes"] + (60 << 20)
    finally:
        child.communicate(b"")


def test_memory_watch_refuses_a_zero_interval():
    with pytest.raises(ValueError, match=r"every_s \(0\) must be > 0"):
        MemoryWatch(every_s=0)


def test_sampling_interns_no_strings(monkeypatch):
    """pathlib (Python <= 3.11) interns each part of a path it builds; a process number interned
    at every sample and freed after it fills CPython's table of interned strings until it doubles
    (seen as a lasting +3.7 MiB step in the controller of a 30-minute soak). /proc is read by
    plain string paths."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    interned = []
    real = sys.intern
    monkeypatch.setattr(sys, "intern", lambda s: interned.append(s) or real(s))
    try:
        watch = MemoryWatch(every_s=1.0)
        watch.sample({"child": child.pid, "self": os.getpid()}, force=True)
        assert child.pid in descendants(os.getpid())
        assert watch.summary()["rss_at_peak_bytes"]["child"] > 0
    finally:
        child.communicate(b"")
    assert interned == []
