"""What the dispatcher's loop uses of its process's context: the declared interface that
``asyncrl.fleet.context.ProcessContext`` satisfies (the dispatcher imports no fleet)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncrl.rundir.ledger import GroupLedger
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import Control, Event

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


@runtime_checkable
class DispatcherContext(Protocol):
    cfg: RunConfig
    """The run's resolved config."""
    endpoints: Endpoints
    """The run's addresses (the dispatcher binds ``dispatcher``)."""
    ledger: GroupLedger
    """This process's ledger lines (``dispatched``)."""
    resume_dir: Path | None
    """The checkpoint to resume from (its ``dispatcher.json``), or None."""

    def emit(self, event: Event) -> None:
        """Send an event to the controller (bounded: see ``ProcessContext.emit``)."""
        ...

    def commands(self) -> list[Control]:
        """Commands addressed to the dispatcher (checkpoint, requeue...), oldest first; never blocks."""
        ...

    def go_given(self) -> bool:
        """Whether the controller said go; never blocks."""
        ...

    def stop_requested(self) -> bool:
        """Whether the controller said stop; never blocks."""
        ...
