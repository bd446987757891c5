"""Every component gives the C allocator's free pages back to the kernel, on a timer."""

import logging

import pytest

from asyncrl.config import RunConfig
from asyncrl.fleet import malloc_trim
from asyncrl.fleet.malloc_trim import MallocTrimmer
from asyncrl.observability.heapwatch import rss_mib
from tests.waits import wait_until

glibc = pytest.mark.skipif(not malloc_trim.available(), reason="the C library is not glibc")


@glibc
def test_a_trim_gives_back_the_pages_of_blocks_freed_between_live_ones():
    # 8 KB blocks (past pymalloc: the C allocator's), one in 50 kept alive: the free ones lie
    # between live blocks, where the allocator does not give them back by itself.
    blocks = [bytes(8000) + bytes([i % 256]) for i in range(20_000)]  # ~160 MB
    kept = blocks[::50]
    del blocks
    before = rss_mib()
    assert malloc_trim.trim() is True
    assert before - rss_mib() > 100, (before, rss_mib())
    assert len(kept) == 400


def test_the_trimmer_trims_on_its_interval_and_logs_the_allocator(caplog):
    caplog.set_level(logging.INFO, logger=malloc_trim.__name__)
    calls = []
    trimmer = MallocTrimmer("gen-0", 0.02, trim_fn=lambda: calls.append(1) or len(calls) % 2 == 0, log_every=2)
    try:
        wait_until(lambda: trimmer.trims >= 4, "four trims, 0.02 s apart")
    finally:
        trimmer.stop()
    assert trimmer.trims == len(calls) and trimmer.released == len(calls) // 2
    logged = [r.getMessage() for r in caplog.records]
    assert logged and all(m.startswith("gen-0: after malloc_trim ") for m in logged), logged
    assert "malloc in use" in logged[0] or "no mallinfo2" in logged[0]


def test_the_trimmer_is_off_at_zero_and_refuses_a_negative_interval():
    assert malloc_trim.start("gen-0", 0) is None
    with pytest.raises(ValueError, match=r"interval_s \(-1\) must be >= 0"):
        malloc_trim.start("gen-0", -1)
    with pytest.raises(ValueError, match=r"interval_s \(0\) must be > 0"):
        MallocTrimmer("gen-0", 0)


@glibc
def test_every_component_starts_one_by_default():
    interval = RunConfig().run.malloc_trim_s
    assert interval > 0
    trimmer = malloc_trim.start("gen-0", interval)
    try:
        assert isinstance(trimmer, MallocTrimmer) and trimmer.interval_s == interval
    finally:
        trimmer.stop()
    with pytest.raises(ValueError, match="malloc_trim_s"):
        RunConfig.model_validate({"run": {"malloc_trim_s": -1}})


def test_the_child_entry_point_starts_the_trimmer_with_the_runs_interval(monkeypatch):
    from asyncrl.fleet import child

    cfg = RunConfig.model_validate({"run": {"malloc_trim_s": 7.5}})
    started, ran = [], []

    class Context:
        def __init__(self, role, name, run_dir):
            self.cfg = cfg

        def close(self):
            pass

    monkeypatch.setattr(child, "configure_process", lambda: None)
    monkeypatch.setattr(child, "ProcessContext", Context)
    monkeypatch.setattr(child.malloc_trim, "start", lambda name, interval: started.append((name, interval)))
    monkeypatch.setattr(child, "entry_function", lambda r: lambda ctx, *model: ran.append(ctx))
    # A child ends by terminating ZeroMQ's context: here that is the test process's, which later tests use.
    monkeypatch.setattr(child, "flush_on_exit", lambda: None)
    assert child.main(["reward", "reward-0", "/nonexistent", "/nonexistent"]) == 0
    assert started == [("reward-0", 7.5)] and len(ran) == 1
