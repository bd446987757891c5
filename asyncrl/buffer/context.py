"""What the buffer service uses of its process's context: the declared interface that
``asyncrl.fleet.context.ProcessContext`` satisfies (the buffer imports no fleet)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncrl.rundir.ledger import GroupLedger
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import Control, Event

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


@runtime_checkable
class BufferContext(Protocol):
    cfg: RunConfig
    """The run's resolved config."""
    endpoints: Endpoints
    """The run's addresses (the buffer binds ``buffer_in``, ``buffer_requests``, ``buffer_status``)."""
    ledger: GroupLedger
    """This process's ledger lines (``held`` at the stop; the service's trained and dropped)."""
    run_dir: Path | None
    """The run directory (the final snapshot goes to ``buffer_snapshot`` in it)."""
    resume_dir: Path | None
    """The checkpoint to restore from (its ``buffer`` part), or None."""

    def emit(self, event: Event) -> None:
        """Send an event to the controller (bounded: see ``ProcessContext.emit``)."""
        ...

    def commands(self) -> list[Control]:
        """Commands addressed to the buffer (checkpoint), oldest first; never blocks."""
        ...

    def stop_requested(self) -> bool:
        """Whether the controller said stop; never blocks."""
        ...
