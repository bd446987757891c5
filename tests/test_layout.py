"""The package's import rules hold: layers, the forbidden imports and no cycles.

The rules are the import-linter contracts in pyproject.toml (``[tool.importlinter]``); this test
runs ``lint-imports`` on the tree under test and fails with its report, which names each broken
contract and the imports that break it.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_imports_keep_the_contracts_in_pyproject():
    # The script beside this interpreter, run from the repository root: it analyses this tree's
    # asyncrl (it puts the working directory first on sys.path), not an installed copy.
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache", "--no-logo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"lint-imports found broken import contracts:\n{result.stdout}{result.stderr}"
    for contract in ("Layers", "Roles never import the controller", "The wire imports no role", "No import cycles"):
        assert contract in result.stdout, f"no contract {contract!r} in pyproject.toml:\n{result.stdout}"
