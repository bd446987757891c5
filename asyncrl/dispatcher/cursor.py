"""Seeded passes over the training prompts, at a position a checkpoint can keep."""

from __future__ import annotations

import numpy as np

from asyncrl.tasks.prompts import Prompt


class PromptCursor:
    """Seeded passes over the prompts; the position is a (epoch, index) pair a checkpoint can keep."""

    def __init__(self, prompts: list[Prompt], seed: int, epochs: int | None):
        if not prompts:
            raise ValueError("the training split has no prompts")
        self.prompts = prompts
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def take(self, k: int) -> list[Prompt]:
        out = []
        while len(out) < k:
            if self.index == len(self._order):
                if self.epochs is not None and self.epoch + 1 >= self.epochs:
                    break
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out
