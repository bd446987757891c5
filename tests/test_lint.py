"""The code lints clean: ruff's rules from pyproject.toml over the package, the tests, the
benchmarks and the scripts. Benchmarks are not imported by any test, so without this a name
error in one is found only when somebody runs it."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run(
        [str(ruff), "check", "--no-cache", "asyncrl", "tests", "bench", "scripts"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"ruff found problems:\n{result.stdout}{result.stderr}"
