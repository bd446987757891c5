"""Rank 0's orders to the other learner ranks: what the whole group does next.

Only rank 0 talks to the rest of the run (the buffer, the generators, the controller's step and
checkpoint accounting); it decides, and every other rank does the same thing at the same time,
because each of these takes collectives on every rank: a training step (DeepSpeed's gradient
reduction), a weight publication under ZeRO-3 (the gathers of the parameters), a checkpoint
(DeepSpeed's per-rank save). ``OrderSender.send`` is a broadcast over the learner's gloo group
(``asyncrl.learner.data_parallel``): it blocks until every rank has the order, at most
``learner.trainer.collective_timeout_s``; nothing is dropped or queued. ``OrderReceiver.next``
blocks the same way for the next order: rank 0 sends one at least every
``learner.batch_timeout_s`` (an ``idle`` when the buffer had no batch), so a wait that reaches
the timeout means rank 0 is gone or stuck.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.learner.data_parallel import DataParallel
from asyncrl.wire.schema import Group

OrderKind = Literal["train", "idle", "publish", "checkpoint", "finish"]


@dataclass
class Order:
    """What every learner rank does next."""

    kind: OrderKind
    """``train`` a step on ``groups``; ``idle``: no batch yet, ask again; ``publish`` the weights
    (take part in the gathers); ``checkpoint``: save this rank's part; ``finish``: training is
    over (save the final model, wait for the stop)."""
    version: int
    """Rank 0's policy version when it gave the order (every rank's, if the group is in step)."""
    groups: list[Group] | None = None
    """The whole batch (``train``): every rank trains its own share of it."""
    is_weights: list[float] | None = None
    """One importance weight per group of ``groups`` (``train``); None: all 1."""


class OrderSender:
    """Rank 0's side: each order reaches every other rank before ``send`` returns."""

    def __init__(self, dp: DataParallel):
        self.dp = dp

    def send(self, order: Order) -> None:
        self.dp.broadcast(order, f"order '{order.kind}'", order.version)


class OrderReceiver:
    """Another rank's side: ``next`` waits for rank 0's next order."""

    def __init__(self, dp: DataParallel):
        self.dp = dp

    def next(self, version: int) -> Order:
        """The next order; ``version``: this rank's, for the error if it never comes."""
        order = self.dp.broadcast(None, "waiting for rank 0's next order", version)
        if order.version != version:
            raise RuntimeError(
                f"learner rank {self.dp.rank} is at version {version}, rank 0's order '{order.kind}' at "
                f"{order.version}: the group is out of step"
            )
        return order
