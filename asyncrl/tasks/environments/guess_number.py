"""A multi-turn guessing game: the model guesses a secret number, the environment answers
"higher" or "lower" until it is found or the turns run out.

The row's ``answer`` is the secret; the range is in the question (``data/guess_number``). A turn's
guess is the last integer in its text; a turn without one is answered with a reminder. Finding
the number earns ``1.0`` (less ``turn_cost`` for each turn before the one that found it), so
fewer guesses are worth more; not finding it earns 0.

``demonstration`` writes the games the warm start learns (``asyncrl.controller.demonstrations``):
the format, and legal play, but not the best strategy (see its docstring).
"""

from __future__ import annotations

import random
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

    def demonstration(self, row: dict, rng: random.Random) -> list[dict]:
        """A game for the warm start: each guess drawn uniformly from the numbers the answers so
        far still allow, until it is found (the generators cut it at ``environment.max_turns``).

        It teaches the format (a bare number a turn, ended by the model) and legal play (guesses in
        the range, above each "higher" and below each "lower"), and finds the number within 4
        turns 58% of the time on 1-16. It leaves the strategy to RL: halving what is left finds
        every number but one within 4 turns, and sooner, which ``turn_cost`` pays for.
        The range is the row's ``low`` and ``high`` columns.
        """
        columns = row.get("columns") or {}
        if "low" not in columns or "high" not in columns:
            raise ValueError(f"a guessing game's row needs columns low and high (it has {sorted(columns)})")
        low, high, secret = int(columns["low"]), int(columns["high"]), int(str(row["answer"]).strip())
        if not low <= secret <= high:
            raise ValueError(f"the secret ({secret}) must be in the row's range [{low}, {high}]")
        messages = []
        while True:
            guess = rng.randint(low, high)
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == secret:
                return messages
            if guess < secret:
                low, hint = guess + 1, self.higher
            else:
                high, hint = guess - 1, self.lower
            messages.append({"role": "user", "content": hint})
