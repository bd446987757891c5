"""Write data/word_arithmetic: two-digit addition and subtraction phrased as short word problems.

The task the real-model recipe (configs/grpo_smollm2_arithmetic.yaml) trains on: hard enough that
SmolLM2-135M-Instruct gets a part of it wrong, easy enough that it gets some right, so that RL has
both to learn from. Deterministic (a fixed seed); the held-out split shares no (a, b, operation)
with the training split.

    .venv/bin/python scripts/make_word_arithmetic.py            # rewrites data/word_arithmetic/
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "word_arithmetic"
SEED = 20261204
TRAIN, TEST = 4000, 400

NAMES = ["Sam", "Mia", "Leo", "Ana", "Tom", "Zoe", "Raj", "Eva", "Ben", "Ivy", "Max", "Lin"]
THINGS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells", "stamps", "beads"]

ADD = [
    "What is {a} plus {b}?",
    "{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
    "A box holds {a} {t}. Someone puts in {b} more. How many {t} are in the box?",
    "{n} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {n} read in all?",
    "Add {a} and {b}.",
]
SUB = [
    "What is {a} minus {b}?",
    "{n} has {a} {t} and gives away {b}. How many {t} does {n} have left?",
    "A shelf holds {a} {t}. {b} are taken away. How many {t} are left on the shelf?",
    "{n} had {a} dollars and spent {b}. How many dollars does {n} have now?",
    "Subtract {b} from {a}.",
]


def problems(rng: random.Random) -> list[dict]:
    """Every (a, b, op) once, shuffled: a, b two-digit; subtraction never goes below zero."""
    out = []
    for a in range(10, 100):
        for b in range(10, 100):
            out.append((a, b, "+"))
            if b <= a:
                out.append((a, b, "-"))
    rng.shuffle(out)
    return [row(rng, a, b, op) for a, b, op in out]


def row(rng: random.Random, a: int, b: int, op: str) -> dict:
    template = rng.choice(ADD if op == "+" else SUB)
    question = template.format(a=a, b=b, n=rng.choice(NAMES), t=rng.choice(THINGS))
    return {"question": question, "answer": str(a + b if op == "+" else a - b), "a": a, "b": b, "op": op}


def write(path: Path, rows: list[dict]) -> str:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    rng = random.Random(SEED)
    rows = problems(rng)
    OUT.mkdir(parents=True, exist_ok=True)
    sums = [f"{write(OUT / 'train.jsonl.gz', rows[:TRAIN])}  train.jsonl.gz"]
    sums.append(f"{write(OUT / 'test.jsonl.gz', rows[TRAIN : TRAIN + TEST])}  test.jsonl.gz")
    (OUT / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print("\n".join(sums))


if __name__ == "__main__":
    main()
