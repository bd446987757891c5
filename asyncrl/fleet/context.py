"""What every child process shares: its config, its event channel to the controller, stop commands.

A component process is started as ``python -m asyncrl.fleet.child ROLE NAME RUN_DIR``; it builds a
``ProcessContext`` which reads the resolved config and the endpoints from the run directory,
serves its Prometheus metrics, and connects to the controller's event (PUSH) and control (SUB)
sockets.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from pathlib import Path

import msgspec

from asyncrl.config import RunConfig, load_run_config
from asyncrl.observability.metrics import serve_metrics, write_metrics_snapshot
from asyncrl.observability.procmem import tree_peak_rss_bytes
from asyncrl.rundir.ledger import LedgerWriter
from asyncrl.wire import security
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import (
    EVENTS,
    Control,
    Event,
    FinalReport,
    GoCommand,
    Message,
    ReleaseWeightsCommand,
    StopCommand,
)
from asyncrl.wire.sockets import StreamSender, Subscriber

log = logging.getLogger(__name__)


class ProcessContext:
    def __init__(
        self,
        role: str,
        name: str,
        run_dir: str | Path | None,
        cfg: RunConfig | None = None,
        endpoints: Endpoints | None = None,
    ):
        """Read config and endpoints from ``run_dir``, or take them as given (a process that joined
        a run by address has no run directory: its metrics port is then not written down)."""
        self.role = role
        self.name = name
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.cfg: RunConfig = cfg if cfg is not None else load_run_config(self.run_dir / "config.yaml")
        self.endpoints = endpoints if endpoints is not None else Endpoints.load(self.run_dir)
        security.configure(self.cfg.security)  # before the first socket: CURVE and size limits
        self.metrics_port = serve_metrics(self.run_dir, name)
        self.events = StreamSender(self.endpoints.events, name=f"{name}.events", hwm=10_000)
        self.control = Subscriber(self.endpoints.control, name=f"{name}.control")
        self._stop = False
        self._go = False
        self.go_command: GoCommand | None = None
        """The controller's go, once given (what it asks of the first weights: ``hold_weights_s``)."""
        self.weights_released = False
        """A generator's starting weights, held by the go, were released (``ReleaseWeightsCommand``)."""
        self._commands: list[Control] = []
        self.started = time.monotonic()
        self.ledger = LedgerWriter(self.run_dir, name, self.cfg.checkpoint.ledger_segment_bytes)
        """This process's lines of the run's group ledger (``asyncrl.rundir.ledger``)."""
        resume = os.environ.get("ASYNCRL_RESUME", "")
        self.resume_dir: Path | None = Path(resume) if resume else None
        """The checkpoint this process starts from (set by the controller on a resume), or None."""

    def emit(self, event: Event) -> None:
        """Send the controller ``event`` (one of the types of ``asyncrl.wire.messages.EVENTS``)
        with this process's name and role as its ``source`` and ``role``; blocks at most 10 s if
        it is not reading. A final report (``asyncrl.wire.finals``) carries the process's peak RSS
        (its live descendants included) as ``peak_rss_bytes``."""
        if not isinstance(event, Event):
            raise TypeError(f"an event must be one of {sorted(EVENTS)}, not {type(event).__name__}")
        event.source, event.role = self.name, self.role
        if isinstance(event, FinalReport) and event.peak_rss_bytes is None:
            event.peak_rss_bytes = tree_peak_rss_bytes()
        try:
            self.events.send(event, timeout=10)
        except TimeoutError:
            log.warning("%s: controller did not take event %r within 10 s", self.name, event.type)

    def report(self, message: Message) -> None:
        """Send the controller a message of its own kind (e.g. ``EvalResult``), with this process's
        name as ``source``; blocks at most 10 s, like ``emit``."""
        try:
            self.events.send(msgspec.structs.replace(message, source=self.name, role=self.role), timeout=10)
        except TimeoutError:
            log.warning("%s: controller did not take a %r within 10 s", self.name, message.kind)

    def stop_requested(self) -> bool:
        """True once the controller said stop to this role (or to everyone); never blocks."""
        self._poll_control()
        return self._stop

    def go_given(self) -> bool:
        """True once the controller said go (every process is ready); never blocks."""
        self._poll_control()
        return self._go

    def commands(self) -> list[Control]:
        """Other commands addressed to this role (checkpoint, requeue...), oldest first; never blocks.
        The controller repeats a command until it sees its effect, so handlers must be idempotent."""
        self._poll_control()
        out, self._commands = self._commands, []
        return out

    def _poll_control(self) -> None:
        for _kind, command in self.control.recv_latest():
            if not isinstance(command, Control) or (command.roles is not None and self.role not in command.roles):
                continue
            if isinstance(command, StopCommand):
                self._stop = True
            elif isinstance(command, GoCommand):
                self._go = True
                self.go_command = command
            elif isinstance(command, ReleaseWeightsCommand):
                self.weights_released = True
            elif len(self._commands) < 1000:  # a flood of commands is bounded, not buffered
                self._commands.append(command)

    def close(self) -> None:
        if self.run_dir is not None:
            write_metrics_snapshot(self.run_dir, self.name)
        self.ledger.close()
        self.events.close()
        self.control.close()


def configure_process() -> None:
    """Per-process settings that matter on a shared CPU box: one math thread, quiet libraries;
    and ``kill -USR1 PID`` writes every thread's stack to the process's log (what a stuck
    process waits on, without stopping it)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
