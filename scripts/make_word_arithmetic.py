"""Write two word-problem tasks into data/: word_arithmetic and word_multiplication.

- ``data/word_arithmetic``: two-digit addition and subtraction as short word problems (the mix
  recipe, configs/grpo_word_arithmetic_mix.yaml).
- ``data/word_multiplication``: the times table from 2 to 12 as short word problems, the task of
  the real-model recipe (configs/grpo_smollm2_arithmetic.yaml). SmolLM2-135M-Instruct, sampled at
  temperature 1, answers about one in six of these right and two-digit sums one in fifty
  (it rambles past the sum): RL needs groups whose answers differ, and the times table gives
  them from the first step.

Deterministic (fixed seeds); a held-out split never shares a problem (a, b, operation) with its
training split.

    .venv/bin/python scripts/make_word_arithmetic.py            # rewrites both folders
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
SEED = 20261204
TRAIN, TEST = 4000, 400
TIMES_RANGE = range(2, 13)
TIMES_TEST_PAIRS = 24
"""Ordered pairs (a, b) held out of the 121 of the times table; their rows are the test split."""
TIMES_ROWS_PER_PAIR = 20

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


MUL = [
    "What is {a} times {b}?",
    "What is {a} multiplied by {b}?",
    "{n} has {a} bags with {b} {t} in each. How many {t} does {n} have?",
    "A box holds {a} rows of {b} {t}. How many {t} are in the box?",
    "Multiply {a} by {b}.",
]


def times_table(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(train, test) rows of a x b: the test rows' pairs never appear in train."""
    pairs = [(a, b) for a in TIMES_RANGE for b in TIMES_RANGE]
    rng.shuffle(pairs)
    test_pairs = set(pairs[:TIMES_TEST_PAIRS])
    train, test = [], []
    for a, b in pairs:
        for _ in range(TIMES_ROWS_PER_PAIR):
            template = rng.choice(MUL)
            question = template.format(a=a, b=b, n=rng.choice(NAMES), t=rng.choice(THINGS))
            row = {"question": question, "answer": str(a * b), "a": a, "b": b, "op": "*"}
            (test if (a, b) in test_pairs else train).append(row)
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


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


def write_split(out: Path, train: list[dict], test: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sums = [
        f"{write(out / 'train.jsonl.gz', train)}  train.jsonl.gz",
        f"{write(out / 'test.jsonl.gz', test)}  test.jsonl.gz",
    ]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print(out.name, len(train), len(test), *sums, sep="\n  ")


def main() -> None:
    rows = problems(random.Random(SEED))
    write_split(DATA / "word_arithmetic", rows[:TRAIN], rows[TRAIN : TRAIN + TEST])
    write_split(DATA / "word_multiplication", *times_table(random.Random(SEED + 1)))


if __name__ == "__main__":
    main()
