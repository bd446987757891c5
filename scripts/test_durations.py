"""The durations record of a full test run, from pytest's JUnit XML, slowest first.

    make test ARGS="--junitxml=/tmp/junit.xml"
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml --wall-s 2554 > tests/durations.txt

Each line: seconds (setup, call and teardown together, as JUnit records them), the outcome and
the test's id. The header gives the total, the share of the ten slowest and the tests not marked
slow (``tests/conftest.py`` fails those over its limit, so they stay a short tail).
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET


def read(path: str) -> list[tuple[float, str, str]]:
    """(seconds, outcome, test id) for every test case of the JUnit file."""
    rows = []
    for case in ET.parse(path).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        module = case.get("classname", "").replace(".", "/")
        rows.append((float(case.get("time", 0.0)), outcome, f"{module}.py::{case.get('name')}"))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest --junitxml output of a full run")
    parser.add_argument("--wall-s", type=float, help="the run's wall time, set-up included, if measured")
    parser.add_argument("--where", default="", help="what ran it (machine, commit), for the header")
    args = parser.parse_args()
    rows = read(args.junit)
    total = sum(s for s, _, _ in rows)
    top = sum(s for s, _, _ in rows[:10])
    print(
        f"# {len(rows)} tests, {total:.0f} s in tests"
        + (f", {args.wall_s:.0f} s wall with set-up" if args.wall_s else "")
    )
    if args.where:
        print(f"# {args.where}")
    print(f"# the ten slowest: {top:.0f} s ({top / max(total, 1e-9):.0%})")
    for seconds, outcome, test in rows:
        print(f"{seconds:9.2f}  {outcome:7s}  {test}")


if __name__ == "__main__":
    main()
