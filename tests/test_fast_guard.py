"""The guard in tests/conftest.py: a test not marked slow that takes too long fails, naming its time."""

import os
from pathlib import Path

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def test_a_slow_test_not_marked_slow_fails_and_a_marked_one_passes(pytester, monkeypatch):
    monkeypatch.setenv("ASYNCRL_FAST_TEST_LIMIT_S", "0.2")
    # The copied conftest imports tests.scheduling from this repository; the inner run is no worker
    # of this one (under pytest-xdist it would share this run's locks).
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    limit = 0.2 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    nap = 2 * limit + 0.3  # past the limit, even if the load rises meanwhile
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n")
    pytester.makepyfile(
        f"""
        import time
        import pytest

        def test_quick():
            pass

        def test_unmarked_and_slow():
            time.sleep({nap})

        @pytest.mark.slow
        def test_marked_and_slow():
            time.sleep({nap})
        """
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked_and_slow took * s (setup and call; *), over the * s allowed*"])


def test_time_spent_waiting_for_a_cpu_is_not_charged(pytester, monkeypatch):
    """A test that does 0.4 s of work on a CPU it shares with three spinning processes takes about
    1.6 s of wall time, over the 1 s limit, and passes: 1.2 s of it was the run queue's, not its own."""
    monkeypatch.setenv("ASYNCRL_FAST_TEST_LIMIT_S", "1.0")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n")
    pytester.makepyfile(
        """
        import os, subprocess, sys, time

        def test_crowded():
            cpu = min(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cpu})
            spin = "import os\\nos.sched_setaffinity(0, {%d})\\nwhile True: pass" % cpu
            hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
            try:
                time.sleep(0.3)  # the hogs are running
                start, worked = time.monotonic(), time.thread_time()
                while time.thread_time() - worked < 0.4:
                    pass
                assert time.monotonic() - start > 1.0  # crowded past the limit, or this proves nothing
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait(timeout=10)
        """
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
