"""The package's import rules hold: layers, the forbidden imports and no cycles; no module is long.

The rules are the import-linter contracts in pyproject.toml (``[tool.importlinter]``); the first
test runs ``lint-imports`` on the tree under test and fails with its report, which names each
broken contract and the imports that break it. Imports made only for annotations count: the
contracts are configured so, and the cycle check below builds its graph with them.
"""

import re
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]

MAX_MODULE_LINES = 500
"""A module that passes this is split by concern (STYLE.md: modules of 100-300 lines)."""

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Import cycles between the modules of one package that are allowed for now, each with its reason
(the acyclic contract in pyproject.toml ignores the same import)."""


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


def test_the_contracts_count_imports_made_only_for_annotations():
    # import-linter counts them unless told otherwise; pyproject.toml says so explicitly.
    section = (REPO / "pyproject.toml").read_text().split("[tool.importlinter]\n", 1)[1].split("\n[", 1)[0]
    setting = re.findall(r"^exclude_type_checking_imports\s*=\s*(\w+)", section, re.MULTILINE)
    assert setting == ["false"], (
        "[tool.importlinter] exclude_type_checking_imports must be false: a module that names a type "
        "depends on the module that declares it"
    )


def _module_cycles(graph: grimp.ImportGraph) -> list[frozenset[str]]:
    """Every set of sibling modules (or subpackages, their descendants folded in) of one package
    that import each other in a cycle: the strongly connected components of more than one."""
    cycles = []
    for package in sorted(m for m in graph.modules if graph.find_children(m)):
        children = sorted(graph.find_children(package))
        members = {m: child for child in children for m in (child, *graph.find_descendants(child))}
        edges = {child: set() for child in children}
        for module, child in members.items():
            for imported in graph.find_modules_directly_imported_by(module):
                target = members.get(imported)
                if target is not None and target != child:
                    edges[child].add(target)
        cycles += _components(edges)
    return cycles


def _components(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_cycle_inside_a_package_annotations_included():
    sys.path.insert(0, str(REPO))  # this tree's asyncrl, not an installed copy
    try:
        graph = grimp.build_graph("asyncrl", exclude_type_checking_imports=False, cache_dir=None)
    finally:
        sys.path.remove(str(REPO))
    cycles = _module_cycles(graph)
    unknown = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    # Between the top-level packages the contracts in pyproject.toml rule (the root config and the
    # roles' config modules); inside a package, only the known cycles are allowed.
    unknown = [c for c in unknown if not all(m.count(".") == 1 for m in c)]
    assert not unknown, f"import cycles inside a package (annotations count): {unknown}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a cycle, remove it from KNOWN_CYCLES: {gone}"


def test_no_module_is_longer_than_the_limit():
    long = {
        str(path.relative_to(REPO)): n
        for folder in ("asyncrl", "bench", "scripts")
        for path in sorted((REPO / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by concern): {long}"


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _components(edges) == [frozenset({"a", "b", "c"})]
