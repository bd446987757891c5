"""What a generator loop uses of its process's context: the declared interface that
``asyncrl.fleet.context.ProcessContext`` satisfies, and ``asyncrl.generators.multiplex.LoopContext``
for each of several loops in one process (the generators import no fleet)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncrl.rundir.ledger import GroupLedger
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import EvalResult, Event, GoCommand

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


@runtime_checkable
class GeneratorContext(Protocol):
    name: str
    """This generator's name (``generator-<index>``: the dispatcher tells generators apart by it)."""
    cfg: RunConfig
    """The run's resolved config."""
    endpoints: Endpoints
    """The run's addresses (a generator binds none)."""
    ledger: GroupLedger
    """This process's ledger lines (``generated``, ``dropped``, ``returned``)."""
    go_command: GoCommand | None
    """The controller's go once given (``hold_weights_s``: ``asyncrl.generators.weights_hold``)."""
    weights_released: bool
    """The controller released the starting weights that its go held."""

    def emit(self, event: Event) -> None:
        """Send an event to the controller (bounded: see ``ProcessContext.emit``)."""
        ...

    def report(self, message: EvalResult) -> None:
        """Send the controller a message of its own kind (an ``EvalResult``)."""
        ...

    def stop_requested(self) -> bool:
        """Whether the controller said stop (or the process is leaving); never blocks."""
        ...
