"""What the controller has heard from the processes, kept by the two parts that read it.

``ProcessReports``: per process, its last event and final report, and who joined the run by
address. ``TrainingProgress``: how far training got (the learner's steps, the version each
generator serves, the times of go and of the last step). Both are written only by the event
routing (``asyncrl.controller.events``) and cleared only by a restore.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncrl.roles import JOINABLE

if TYPE_CHECKING:
    from asyncrl.wire.messages import DoneEvent, Event, FinalReport, StepEvent


@dataclass
class ProcessReports:
    """Per process name: the last event and when it came, the final report; the joined processes."""

    last_event: dict[str, Event] = field(default_factory=dict)
    last_event_at: dict[str, float] = field(default_factory=dict)
    finals: dict[str, FinalReport] = field(default_factory=dict)
    """Each process's final report (its role's type, ``asyncrl.wire.finals``)."""
    joined: dict[str, str] = field(default_factory=dict)
    """Processes that joined by address (not started by this controller): name -> role."""

    def record(self, ev: Event, started_here: bool) -> None:
        """Note ``ev`` as its source's last word (and its final report, if it is one); a source
        of a joinable role that this controller did not start has joined the run."""
        source = ev.source
        self.last_event[source] = ev
        self.last_event_at[source] = time.monotonic()
        if not started_here and ev.role in JOINABLE:
            self.joined.setdefault(source, ev.role)
        if ev.final:
            self.finals[source] = ev

    def joined_without_final(self, roles: list[str]) -> list[str]:
        """Joined processes of ``roles`` that have not sent their final report."""
        return [n for n, role in self.joined.items() if role in roles and n not in self.finals]

    def count_joined(self, role: str) -> int:
        return sum(1 for r in self.joined.values() if r == role)


@dataclass
class TrainingProgress:
    """How far the run got: steps seen, the learner's last report, what each generator serves."""

    steps_seen: int = 0
    version: int | None = None
    """The policy version of the learner's last step seen (None before the first)."""
    step_seconds: list[float] = field(default_factory=list)
    """Each learner step's ``step_s``."""
    generator_versions: dict[str, int] = field(default_factory=dict)
    """Generator name -> the policy version it last said it serves."""
    learner_done: DoneEvent | None = None
    """The learner's ``done`` event, once it took its last step."""
    go_at: float = 0.0
    """Monotonic time of the first "go"."""
    done_at: float = 0.0
    """Monotonic time of the learner's ``done`` (0 until then)."""

    def on_step(self, ev: StepEvent) -> float:
        """Count a learner step; returns the seconds since go (``t``: the x axis of throughput plots)."""
        self.steps_seen += 1
        self.version = ev.version
        self.step_seconds.append(ev.stats.step_s)
        return time.monotonic() - self.go_at

    def on_learner_done(self, ev: DoneEvent) -> None:
        self.learner_done = ev
        self.done_at = time.monotonic()

    def final_version(self) -> int:
        return self.learner_done.version
