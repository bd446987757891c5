"""What a reward worker uses of its process's context: the declared interface that
``asyncrl.fleet.context.ProcessContext`` satisfies (the reward workers import no fleet)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import Event

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


@runtime_checkable
class RewardContext(Protocol):
    name: str
    """This worker's name (``reward-0`` owns the stream; joined workers have their own)."""
    cfg: RunConfig
    """The run's resolved config (a joined worker's with its ``reward.`` overrides)."""
    endpoints: Endpoints
    """The run's addresses (the owner binds ``reward_in`` and ``reward_share``)."""

    def emit(self, event: Event) -> None:
        """Send an event to the controller (bounded: see ``ProcessContext.emit``)."""
        ...

    def stop_requested(self) -> bool:
        """Whether the controller said stop; never blocks."""
        ...
