"""Write data/guess_number: the rows of the multi-turn guessing game
(``asyncrl.tasks.environments.guess_number``).

Each row: ``question`` (the game's opening line), ``answer`` (the secret number, as a string),
``low`` and ``high`` (the range). Secrets run from 1 to 16 in both files: the held-out rows
(``test.jsonl.gz``) are games of their own, drawn apart from the training ones. The prompt says
nothing of the secret, so no answer can be memorised from it: what a held-out game measures is
how the policy plays, which is what training shapes. (Holding secrets out instead measures
something else: a policy trained well never guesses a number that is never the secret, and so
never finds the held-out ones.) Deterministic; run it to rebuild the files, ``SHA256SUMS`` checks
them.

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
    secrets = list(range(LOW, HIGH + 1))
    sums = {
        "train.jsonl.gz": write(OUT / "train.jsonl.gz", rows(secrets, TRAIN_ROWS, rng)),
        "test.jsonl.gz": write(OUT / "test.jsonl.gz", rows(secrets, TEST_ROWS, rng)),
    }
    (OUT / "SHA256SUMS").write_text("".join(f"{digest}  {name}\n" for name, digest in sums.items()))


if __name__ == "__main__":
    main()
