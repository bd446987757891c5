"""Write data/guess_number: the rows of the multi-turn guessing game
(``asyncrl.tasks.environments.guess_number``).

Each row: ``question`` (the game's opening line), ``answer`` (the secret number, as a string),
``low`` and ``high`` (the range). Secrets run from 1 to 16; four of them are held out (their rows
are ``test.jsonl.gz``), so a held-out success is a strategy that finds numbers it never found in
training, not a memorised one. Deterministic; run it to rebuild the files, ``SHA256SUMS`` checks them.

    .venv/bin/python scripts/make_guess_number.py
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "guess_number"
SEED = 20261205
LOW, HIGH = 1, 16
HELD_OUT = (3, 8, 11, 14)
TRAIN_ROWS, TEST_ROWS = 1200, 200


def rows(secrets: list[int], count: int, rng: random.Random) -> list[dict]:
    return [
        {"question": f"guess {LOW}-{HIGH}:", "answer": str(rng.choice(secrets)), "low": LOW, "high": HIGH}
        for _ in range(count)
    ]


def write(path: Path, data: list[dict]) -> str:
    raw = "".join(json.dumps(row) + "\n" for row in data).encode()
    path.write_bytes(gzip.compress(raw, mtime=0))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    rng = random.Random(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    train = [s for s in range(LOW, HIGH + 1) if s not in HELD_OUT]
    sums = {
        "train.jsonl.gz": write(OUT / "train.jsonl.gz", rows(train, TRAIN_ROWS, rng)),
        "test.jsonl.gz": write(OUT / "test.jsonl.gz", rows(list(HELD_OUT), TEST_ROWS, rng)),
    }
    (OUT / "SHA256SUMS").write_text("".join(f"{digest}  {name}\n" for name, digest in sums.items()))


if __name__ == "__main__":
    main()
