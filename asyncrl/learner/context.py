"""What the learner process needs from its process context: a small declared interface.

``run_learner`` reads the run's config, its endpoints, its run directory, the checkpoint it
resumes from, its ledger, sends events and polls for a stop; nothing else. Declaring that as a
``typing.Protocol`` lets a test (or another launcher) hand the loop any object that has those
members, and keeps the learner from depending on ``asyncrl.fleet`` (a higher layer):
``asyncrl.fleet.context.ProcessContext`` satisfies it structurally, without naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.rundir.ledger import LedgerWriter
    from asyncrl.wire.endpoints import Endpoints


class LearnerContext(Protocol):
    """The members of a process context that ``run_learner`` uses."""

    @property
    def cfg(self) -> RunConfig:
        """The run's resolved config."""
        ...

    @property
    def endpoints(self) -> Endpoints:
        """Addresses of the buffer's request socket, the weight channels and the KL reference."""
        ...

    @property
    def run_dir(self) -> Path | None:
        """The run directory (checkpoints, the final model, weight files); None for a process
        joined by address."""
        ...

    @property
    def resume_dir(self) -> Path | None:
        """The checkpoint to resume from, or None for a fresh start."""
        ...

    @property
    def ledger(self) -> LedgerWriter:
        """This process's lines of the run's group ledger (``trained``, ``dropped``, ``held``)."""
        ...

    def emit(self, type: str, **fields) -> None:
        """Send an event (``ready``, ``step``, ``broadcast``, ``checkpoint_part``, ``done``,
        ``final``) to the controller."""
        ...

    def stop_requested(self) -> bool:
        """Whether the controller has asked this process to stop."""
        ...
