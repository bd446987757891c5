"""What the controller does when a component process dies.

- A generator, a reward worker or the reference process holds no state worth keeping: it is
  started again after a backoff (``backoff_initial_s``, doubling up to ``backoff_max_s``), and the
  dispatcher hands out again the prompts whose groups it may have held (the groups' ids keep
  training exactly-once if a copy survives after all).
- The buffer is started again empty; the dispatcher hands out again every group that was in it
  and not yet trained.
- The learner or the dispatcher: with ``restore_on_crash``, the whole run goes back to its last
  checkpoint (every process restarted from it, as ``asyncrl train --resume`` does); otherwise the
  run stops with an error.

A component that dies more than ``max_restarts`` times is not started again: the run stops with
an error naming it.
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.configbase import Config

STATELESS_ROLES = ("generator", "reward", "reference")


class SupervisionConfig(Config):
    restart: bool = True
    """Start a dead generator, reward worker, reference or buffer again (False: a death stops the run)."""
    restore_on_crash: bool = True
    """When the learner or the dispatcher dies, restart the whole run from its last checkpoint."""
    max_restarts: int = Field(10, ge=0)
    """Restarts allowed per component (restores of the whole run count once per component)."""
    backoff_initial_s: float = Field(1.0, ge=0)
    """Wait before the first restart of a component."""
    backoff_max_s: float = Field(30.0, ge=0)
    """The wait doubles with each restart of the same component, up to this."""


class Backoff:
    """Exponential backoff per component name.

    >>> b = Backoff(1.0, 5.0)
    >>> [b.next("g") for _ in range(4)]
    [1.0, 2.0, 4.0, 5.0]
    """

    def __init__(self, initial_s: float, max_s: float):
        self.initial_s, self.max_s = initial_s, max_s
        self.restarts: dict[str, int] = {}

    def next(self, name: str) -> float:
        k = self.restarts.get(name, 0)
        self.restarts[name] = k + 1
        return min(self.max_s, self.initial_s * 2**k)

    def count(self, name: str) -> int:
        return self.restarts.get(name, 0)
