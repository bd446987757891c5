"""Seeded passes over the training prompts, at a position a checkpoint can keep; several sources
mixed by weight at positions a checkpoint keeps as well."""

from __future__ import annotations

import numpy as np

from asyncrl.tasks.prompts import Prompt


class PromptCursor:
    """Seeded passes over the prompts; the position is a (epoch, index) pair a checkpoint can keep.
    ``stream`` tells apart the orders of the sources of a mix drawn under one seed."""

    def __init__(self, prompts: list[Prompt], seed: int, epochs: int | None, stream: int | None = None):
        if not prompts:
            raise ValueError("the training split has no prompts")
        self.prompts = prompts
        self.seed = seed
        self.stream = stream
        self.epochs = epochs
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        key = [self.seed, epoch] if self.stream is None else [self.seed, self.stream, epoch]
        return np.random.default_rng(key).permutation(len(self.prompts))

    @property
    def drawn(self) -> int:
        """Prompts taken so far, over every pass."""
        return self.epoch * len(self.prompts) + self.index

    @property
    def exhausted(self) -> bool:
        return self.index == len(self._order) and self.epochs is not None and self.epoch + 1 >= self.epochs

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

    def state(self) -> dict:
        """The position, as the dispatcher's checkpoint keeps it."""
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict) -> None:
        if "sources" in state:
            raise ValueError(
                f"the checkpoint's cursor mixes {len(state['sources'])} sources, this run's task has none: "
                "resume with the task.sources it was trained with"
            )
        if not 0 <= int(state["index"]) <= len(self.prompts):
            raise ValueError(
                f"the checkpoint's cursor index ({state['index']}) must be within this run's {len(self.prompts)} "
                "training prompts: resume with the task it was trained with"
            )
        self.epoch = int(state["epoch"])
        self._order = self._permutation(self.epoch)
        self.index = int(state["index"])


class MixedCursor:
    """Sources mixed by weight: a deterministic weighted round robin over one ``PromptCursor`` each.

    With weights w_i (W their sum) and n_i prompts drawn from source i so far (N in all), the next
    prompt comes from the source furthest behind its share: argmax_i (w_i / W) · (N + 1) − n_i
    (the first such source on a tie). Every prefix of the draws is then within one prompt of
    each source's share, with no randomness beyond each source's own seeded order, so the
    position (each source's epoch and index) is the whole state: a resumed run continues the
    same sequence, and the dispatcher's at-least-once bookkeeping (by group id) is untouched.
    A source that has finished its ``epochs`` passes leaves the mix; the others go on by their
    weights, and the mix ends with the last.

    >>> from asyncrl.tasks.prompts import Prompt
    >>> a = [Prompt(f"a{i}", "", "", "a") for i in range(100)]
    >>> b = [Prompt(f"b{i}", "", "", "b") for i in range(100)]
    >>> "".join(p.task for p in MixedCursor([(a, 3.0), (b, 1.0)], seed=0, epochs=None).take(8))
    'aabaaaba'
    """

    def __init__(self, sources: list[tuple[list[Prompt], float]], seed: int, epochs: int | None):
        if not sources:
            raise ValueError("a mix needs at least one source")
        for _prompts, weight in sources:
            if not weight > 0:
                raise ValueError(f"a source's weight ({weight}) must be > 0")
        self.cursors = [PromptCursor(prompts, seed, epochs, stream=i) for i, (prompts, _w) in enumerate(sources)]
        self.weights = [float(w) for _p, w in sources]

    @property
    def epoch(self) -> int:
        """The fewest passes any source has begun (the mix's epoch, for reports)."""
        return min(c.epoch for c in self.cursors)

    @property
    def index(self) -> int:
        """Prompts drawn so far from every source (for reports)."""
        return sum(c.drawn for c in self.cursors)

    def _next_source(self) -> PromptCursor | None:
        active = [(c, w) for c, w in zip(self.cursors, self.weights) if not c.exhausted]
        if not active:
            return None
        total_w, total_n = sum(w for _c, w in active), sum(c.drawn for c, _w in active)
        return max(active, key=lambda cw: cw[1] / total_w * (total_n + 1) - cw[0].drawn)[0]

    def take(self, k: int) -> list[Prompt]:
        out = []
        while len(out) < k:
            cursor = self._next_source()
            if cursor is None:
                break
            out.extend(cursor.take(1))
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "sources": [c.state() for c in self.cursors]}

    def restore(self, state: dict) -> None:
        sources = state.get("sources")
        if sources is None or len(sources) != len(self.cursors):
            raise ValueError(
                f"the checkpoint's cursor has {0 if sources is None else len(sources)} sources, this run's task "
                f"has {len(self.cursors)}: resume with the task.sources it was trained with"
            )
        for cursor, part in zip(self.cursors, sources):
            cursor.restore(part)


def make_cursor(prompts: list[Prompt], weights: dict[str, float] | None, seed: int, epochs: int | None):
    """A ``PromptCursor`` over ``prompts``, or with ``weights`` (task name -> weight, a mix of
    sources) a ``MixedCursor`` over each task's prompts in the order of ``weights``."""
    if not weights:
        return PromptCursor(prompts, seed, epochs)
    by_task: dict[str, list[Prompt]] = {name: [] for name in weights}
    for prompt in prompts:
        by_task[prompt.task].append(prompt)
    empty = [name for name, part in by_task.items() if not part]
    if empty:
        raise ValueError(f"task.sources {empty} have no training prompts")
    return MixedCursor([(by_task[name], weights[name]) for name in weights], seed, epochs)
