"""A reward function for data/word_arithmetic, as a user writes one (``reward.rewards[].kind: python``).

It reads the row's own columns (``a``, ``b``, ``op``) rather than a reference string, so the rule
lives next to the data: 1.0 when the last number of the completion is the result, 0.0 when it is
another number, and ``Unscored`` when the completion ends early without one (``length``: the
answer was cut, not wrong). Named in a recipe as
``function: configs/rewards/word_arithmetic.py:reward`` (a path relative to the working directory).
"""

import re

from asyncrl.rewards import Unscored

NUMBER = re.compile(r"-?\d+")


def reward(completion: str, row: dict, finish_reason: str) -> float | Unscored:
    numbers = NUMBER.findall(completion.replace(",", ""))
    if not numbers:
        if finish_reason == "length":
            return Unscored("cut_short", "the answer was cut before it gave a number")
        return 0.0
    result = row["a"] + row["b"] if row["op"] == "+" else row["a"] - row["b"]
    return float(int(numbers[-1]) == result)
