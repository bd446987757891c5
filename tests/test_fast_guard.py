"""The guard in tests/conftest.py: a test not marked slow that takes too long fails, naming its time."""

from pathlib import Path

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def test_a_slow_test_not_marked_slow_fails_and_a_marked_one_passes(pytester, monkeypatch):
    monkeypatch.setenv("ASYNCRL_FAST_TEST_LIMIT_S", "0.2")
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n")
    pytester.makepyfile(
        """
        import time
        import pytest

        def test_quick():
            pass

        def test_unmarked_and_slow():
            time.sleep(0.4)

        @pytest.mark.slow
        def test_marked_and_slow():
            time.sleep(0.4)
        """
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked_and_slow took 0.* s (setup and call), over the 0.2 s allowed*"])
