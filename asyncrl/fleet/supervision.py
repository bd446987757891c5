"""What the controller does when a component process dies (``supervision`` section:
``asyncrl.fleet.config.SupervisionConfig``; the controller acts in ``asyncrl.controller.supervision``).

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
