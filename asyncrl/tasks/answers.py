"""Scoring a response against a reference answer: the tasks' rules, and a batch's accuracy."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

TASKS = ("addition", "gsm8k")


# A number as people write it: optional sign, digits with thousands commas, optional decimals.
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####``, commas removed; None if there is no such number."""
    if "####" not in text:
        return None
    match = NUMBER_RE.search(text.rsplit("####", 1)[1])
    return match.group().replace(",", "") if match else None


def last_number(text: str) -> str | None:
    """The last number written in ``text``, commas removed; None if there is none."""
    numbers = NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def parse_number(text: str) -> Decimal | None:
    """``"1,000"`` -> Decimal(1000); None when ``text`` is not a number."""
    try:
        return Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None


def score_answer(task: str, response: str, answer: str) -> float:
    """Exact match of a model response against the reference answer: 1.0 or 0.0.

    addition: the whitespace-stripped response must equal the answer.
    gsm8k: the number after ``####`` (else the last number in the response) must equal the
    answer numerically, so ``"1,000"`` matches ``"1000"`` and ``"3.0"`` matches ``"3"``.
    Any other task (one of the user's): gsm8k's rule when the answer is a number, else the
    whitespace-stripped response must equal it. A task without an answer ("") has nothing to
    match: that is an error, so exact match on it leaves the group unscored with the reason.
    """
    if task == "addition":
        return float(response.strip() == answer.strip())
    if task == "gsm8k" or (task not in TASKS and parse_number(answer) is not None):
        predicted = extract_gsm8k_answer(response)
        if predicted is None:
            predicted = last_number(response)
        if predicted is None:
            return 0.0
        want, got = parse_number(answer), parse_number(predicted)
        if want is None or got is None:
            return float(predicted.strip() == answer.strip())
        return float(want == got)
    if not answer.strip():
        raise ValueError(f"task ({task!r}) has no reference answer: set task.data.answer_key, or score it otherwise")
    return float(response.strip() == answer.strip())


CORRECTNESS_REWARDS = ("exact_match", "math_verify")
"""Rewards whose value is right (1) or wrong (0): their mean over a batch is its accuracy."""


def batch_accuracy(groups) -> float | None:
    """Share of a batch's samples that a correctness reward (``CORRECTNESS_REWARDS``, by name)
    scored 1; None when no such reward scored them (a judge or a reward model only)."""
    right = total = 0
    for group in groups:
        for sample in group.samples:
            parts = [v for k, v in sample.reward_parts.items() if k in CORRECTNESS_REWARDS and v is not None]
            if parts:
                total += 1
                right += max(parts) >= 1.0
    return right / total if total else None
