"""What the learner process uses of its process's context: the declared interface that
``asyncrl.fleet.context.ProcessContext`` satisfies (the learner imports no fleet).

``run_learner`` reads the run's config, its endpoints, its run directory and the checkpoint it
resumes from, writes ledger lines, sends events and polls for a stop; nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncrl.rundir.ledger import GroupLedger
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import Event

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


@runtime_checkable
class LearnerContext(Protocol):
    cfg: RunConfig
    """The run's resolved config."""
    endpoints: Endpoints
    """The run's addresses (the buffer's ``buffer_requests``, the weight channels, the KL ``reference``)."""
    ledger: GroupLedger
    """This process's ledger lines (``trained``, ``dropped`` duplicates, ``held`` at the stop)."""
    run_dir: Path | None
    """The run directory (checkpoint parts, weight files, the final model in ``final``)."""
    resume_dir: Path | None
    """The checkpoint to restore from (its ``learner`` part), or None."""

    def emit(self, event: Event) -> None:
        """Send an event (``ReadyEvent``, ``BroadcastEvent``, ``CheckpointPartEvent``, ``StepEvent``,
        ``DoneEvent``, ``LearnerFinal``) to the controller (bounded: see ``ProcessContext.emit``)."""
        ...

    def stop_requested(self) -> bool:
        """Whether the controller said stop; never blocks."""
        ...
