"""The controller's event loop: one event at a time from every process, handed to the parts
it concerns.

``EventPump.next`` is the only place the controller waits. Before each read it runs its duties
(supervision, resending commands, checkpoint deadlines, evaluation requests, memory samples), so
they run however long a phase waits; every read is bounded (``wait``) and every phase that
loops on it has a deadline or a watchdog. ``EventRouter`` hands each event to its owners: the
checkpoint coordinator, the supervisor, the training progress, the weight-publication timeline
and its metrics, ``steps.jsonl``, the console, and (``samples`` events) ``samples.jsonl``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from asyncrl.controller.checkpointing import CheckpointCoordinator
from asyncrl.controller.commands import CommandSender
from asyncrl.controller.errors import RunError
from asyncrl.controller.evaluation import Evaluations
from asyncrl.controller.reports import ProcessReports, TrainingProgress
from asyncrl.controller.supervision import Supervisor
from asyncrl.observability.metrics import WEIGHT_SERVED_SECONDS
from asyncrl.observability.progress import RunProgress
from asyncrl.weights.timeline import PublicationTimeline
from asyncrl.wire.messages import (
    BroadcastEvent,
    CheckpointPartEvent,
    DoneEvent,
    ErrorEvent,
    EvalResult,
    Event,
    HeartbeatEvent,
    ReadyEvent,
    RequeuedEvent,
    SamplesEvent,
    StepEvent,
    VersionEvent,
)
from asyncrl.wire.sockets import StreamReceiver

log = logging.getLogger("asyncrl")


class EventPump:
    """Runs the duties, reads one event, records it as its source's last word, routes it."""

    def __init__(
        self,
        receiver: StreamReceiver,
        fleet,
        reports: ProcessReports,
        route: Callable[[Event], None],
        duties: Iterable[Callable[[], None]] = (),
        on_eval_result: Callable[[dict], None] | None = None,
    ):
        """``fleet``: the processes this controller started (``procs``: name -> process); an
        event from any other source is from a process that joined by address."""
        self.receiver = receiver
        self.fleet = fleet
        self.reports = reports
        self.route = route
        self.duties = list(duties)
        self.on_eval_result = on_eval_result

    def next(self, deadline: float | None, waiting_for: str, wait: float = 0.5) -> Event | None:
        """The next event, or None after ``wait`` seconds without one (or for a message that is
        not an event). Raises ``RunError`` naming ``waiting_for`` once past ``deadline``."""
        if deadline is not None and time.monotonic() > deadline:
            raise RunError(f"timed out waiting for {waiting_for}")
        for duty in self.duties:
            duty()
        msg = self.receiver.recv(timeout=wait)
        if msg is None:
            return None
        if isinstance(msg[1], EvalResult):
            if self.on_eval_result is not None:
                self.on_eval_result(msg[1])
            return None
        if not isinstance(msg[1], Event):
            return None
        ev = msg[1]
        self.reports.record(ev, started_here=ev.source in self.fleet.procs)
        self.route(ev)
        return ev


class EventRouter:
    """Hands each event to the parts that own what it changes."""

    def __init__(
        self,
        run_dir: Path,
        progress: TrainingProgress,
        checkpoints: CheckpointCoordinator,
        commands: CommandSender,
        supervisor: Supervisor,
        evaluations: Evaluations,
        timeline: PublicationTimeline,
        console: RunProgress,
    ):
        self.run_dir = run_dir
        self.progress = progress
        self.checkpoints = checkpoints
        self.commands = commands
        self.supervisor = supervisor
        self.evaluations = evaluations
        self.timeline = timeline
        self.console = console

    def route(self, ev: Event) -> None:
        if isinstance(ev, CheckpointPartEvent):
            self.checkpoints.on_part(ev)
        elif isinstance(ev, RequeuedEvent):
            self.commands.acked(ev.id)
        elif isinstance(ev, DoneEvent) and ev.role == "learner":
            self.progress.on_learner_done(ev)
        elif isinstance(ev, ErrorEvent):
            self.supervisor.on_error(ev)
        elif isinstance(ev, BroadcastEvent):
            observe_served(self.timeline.on_broadcast(ev))
        elif isinstance(ev, VersionEvent):
            self.progress.generator_versions[ev.source] = ev.version
            observe_served(self.timeline.on_served(ev))
            log.info("%s now serves policy version %d (applied in %.0f ms)", ev.source, ev.version, 1000 * ev.apply_s)
            if ev.probe is not None:  # one line per (version, generator): the probe's statistics
                record = {"version": ev.version, "generator": ev.source, **msgspec.structs.asdict(ev.probe)}
                with open(self.run_dir / "probes.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
        elif isinstance(ev, StepEvent):
            t = self.progress.on_step(ev)
            self.evaluations.on_step(ev.version)
            with open(self.run_dir / "steps.jsonl", "a") as f:  # one line per step, for plots and tools
                f.write(json.dumps(ev.record(t)) + "\n")
            self.console.step(ev.stats, t)
        elif isinstance(ev, SamplesEvent):
            self.console.samples(ev.version, msgspec.to_builtins(ev.samples))  # samples.jsonl, TensorBoard text
            return
        elif isinstance(ev, ReadyEvent) and ev.role == "generator":
            self.progress.generator_versions[ev.source] = ev.version or 0
        elif isinstance(ev, HeartbeatEvent):
            return  # it only keeps its source's last word fresh (``ProcessReports``, supervision)
        self.console.update(ev)


def observe_served(records: list[dict]) -> None:
    """Publication-to-served seconds of each version a generator now serves, into the metrics."""
    for record in records:
        WEIGHT_SERVED_SECONDS.labels("total").observe(record["total_s"])
        for stage, seconds in record.items():
            if stage != "total_s":
                WEIGHT_SERVED_SECONDS.labels(stage.removesuffix("_s")).observe(seconds)
