"""``Unscored``: the result of a reward that could not score a sample, never a 0 by accident.

Its own small module so that a user's reward function can return it (``from asyncrl.rewards
import Unscored``) without importing the reward worker's machinery, and so that the child process
running such a function stays light.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unscored:
    """A sample a reward could not score; ``reason`` is a short label (``http_429``, ``timeout``)
    counted in metrics, ``detail`` free text kept with the group.

    >>> Unscored("no_answer", "the completion names no number")
    Unscored(reason='no_answer', detail='the completion names no number')
    """

    reason: str
    detail: str = ""
