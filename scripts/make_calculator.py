"""Write data/calculator: arithmetic the demo-sized model cannot do alone, with a calculator tool
(``asyncrl.tasks.environments.calculator``).

Each row: ``question`` (``23*47=``), ``answer`` (the value, as a string) and ``expression``
(``23*47``, what a call of the tool computes). Half the rows are products of two two-digit
numbers, half sums of three: a model of a million parameters gets almost none of them right
from a short warm start, and a call of the tool gets every one. No expression is in both
splits, so a held-out success is a call the model learned to make, not a memorised answer.
Deterministic; run it to rebuild the files, ``SHA256SUMS`` checks them.

    .venv/bin/python scripts/make_calculator.py
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "calculator"
SEED = 20261205
TRAIN_ROWS, TEST_ROWS = 4000, 400


def expression(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{rng.randint(10, 99)}*{rng.randint(10, 99)}"
    return "+".join(str(rng.randint(10, 99)) for _ in range(3))


def row(expr: str) -> dict:
    a, op, rest = expr[:2], expr[2], expr[3:]
    value = int(a) * int(rest) if op == "*" else sum(int(x) for x in expr.split("+"))
    return {"question": f"{expr}=", "answer": str(value), "expression": expr}


def write(path: Path, data: list[dict]) -> str:
    raw = "".join(json.dumps(r) + "\n" for r in data).encode()
    path.write_bytes(gzip.compress(raw, mtime=0))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    rng = random.Random(SEED)
    seen: list[str] = []
    distinct: set[str] = set()
    while len(seen) < TRAIN_ROWS + TEST_ROWS:
        expr = expression(rng)
        if expr not in distinct:
            distinct.add(expr)
            seen.append(expr)
    test, train = seen[:TEST_ROWS], seen[TEST_ROWS:]
    OUT.mkdir(parents=True, exist_ok=True)
    sums = {
        "train.jsonl.gz": write(OUT / "train.jsonl.gz", [row(e) for e in train]),
        "test.jsonl.gz": write(OUT / "test.jsonl.gz", [row(e) for e in test]),
    }
    (OUT / "SHA256SUMS").write_text("".join(f"{digest}  {name}\n" for name, digest in sums.items()))


if __name__ == "__main__":
    main()
