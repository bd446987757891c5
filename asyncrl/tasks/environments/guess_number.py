"""A multi-turn guessing game: the model guesses a secret number, the environment answers
"higher" or "lower" until it is found or the turns run out.

The row's ``answer`` is the secret; the range is in the question (``data/guess_number``). A turn's
guess is the last integer in its text; a turn without one is answered with a reminder. Finding
the number earns ``1.0`` (less ``turn_cost`` for each turn before the one that found it), so
fewer guesses are worth more; not finding it earns 0.
"""

from __future__ import annotations

import re

from asyncrl.tasks.environments.base import Step

_INTEGER = re.compile(r"-?\d+")


class GuessNumber:
    """The guessing game (see the module docstring); one instance per episode."""

    def __init__(
        self, turn_cost: float = 0.0, higher: str = "higher", lower: str = "lower", reminder: str = "a number?"
    ):
        if not 0.0 <= turn_cost < 1.0:
            raise ValueError(f"turn_cost ({turn_cost}) must be in [0, 1)")
        self.turn_cost, self.higher, self.lower, self.reminder = turn_cost, higher, lower, reminder
        self.secret: int | None = None
        self.turns = 0

    async def reset(self, row: dict) -> None:
        self.secret = int(str(row["answer"]).strip())
        self.turns = 0

    async def step(self, text: str) -> Step:
        self.turns += 1
        guesses = _INTEGER.findall(text)
        if not guesses:
            return Step(messages=[{"role": "user", "content": self.reminder}])
        guess = int(guesses[-1])
        if guess == self.secret:
            return Step(reward=max(0.0, 1.0 - self.turn_cost * (self.turns - 1)), done=True)
        hint = self.higher if guess < self.secret else self.lower
        return Step(messages=[{"role": "user", "content": hint}])

    async def close(self) -> None:
        pass
