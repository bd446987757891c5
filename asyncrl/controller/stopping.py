"""Stopping one stage of the dataflow and waiting for its final reports.

Each stage is told to stop (the command repeated, PUB drops what a slow subscriber misses) until
every process of it has sent its final report and exited, within a deadline. A process that
joined the run by address (``asyncrl reward-worker --connect``) is waited for too, up to
``JOINED_STOP_S``: stopping the next stage first would leave what it still forwards nowhere to
go, and its counts out of the summary. It is not ours to watch exit.
"""

from __future__ import annotations

import logging
import time

from asyncrl.controller.commands import CommandSender
from asyncrl.controller.events import EventPump
from asyncrl.controller.reports import ProcessReports, TrainingProgress
from asyncrl.controller.watchdog import StallWatch
from asyncrl.weights.timeline import PublicationTimeline
from asyncrl.wire.messages import StopCommand

log = logging.getLogger("asyncrl")

JOINED_STOP_S = 30.0
"""Seconds the stop waits for a joined process's final report once the run's own are in."""
STOP_FLOOR_S = 120.0
"""Least seconds a stage's stop waits for its final reports (else the stall bound, if longer)."""
FINAL_WEIGHTS_FLOOR_S = 60.0
"""Least seconds the stop waits for every generator to serve the final version."""


class Stopper:
    """Stops stages of the run's processes, each waited for within a bound."""

    def __init__(self, fleet, commands: CommandSender, pump: EventPump, reports: ProcessReports, watch: StallWatch):
        """``fleet``: the processes this controller started (``names(role)``, ``exited(names)``)."""
        self.fleet = fleet
        self.commands = commands
        self.pump = pump
        self.reports = reports
        self.watch = watch

    def stop(self, roles: list[str], timeout: float | None = None) -> None:
        """Stop ``roles`` and wait for each process's final report, at most ``timeout`` seconds
        (default: the stall bound, since a generator finishes the batch it samples, at least
        ``STOP_FLOOR_S``); joined processes of ``roles`` up to ``JOINED_STOP_S`` more."""
        names = [n for r in roles for n in self.fleet.names(r)]
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else max(STOP_FLOOR_S, self.watch.bound()))
        while True:
            joined = self.reports.joined_without_final(roles)
            if all(n in self.reports.finals for n in names) and self.fleet.exited(names):
                if not joined:
                    return
                if time.monotonic() - start > JOINED_STOP_S:
                    log.warning(
                        "%s joined the run and sent no final report within %.0f s of the stop: "
                        "its counts are not in the summary",
                        ", ".join(sorted(joined)),
                        JOINED_STOP_S,
                    )
                    return
            self.commands.broadcast(StopCommand(), roles)
            self.pump.next(deadline, f"{', '.join(roles)} to stop", wait=0.2)

    def await_final_weights(
        self, progress: TrainingProgress, timeline: PublicationTimeline, timeout: float | None = None
    ) -> None:
        """With no more prompts, every generator picks up the last published version: within
        ``timeout`` seconds, by default ``stall_factor`` × the longest publication-to-served time
        seen (at least ``FINAL_WEIGHTS_FLOOR_S``): a generator first finishes its batch. Past it,
        the stop goes on and says which versions are served."""
        final = progress.final_version()
        if timeout is None:
            served = timeline.summary()["total_s"].get("max")
            timeout = self.watch.scaled(served, FINAL_WEIGHTS_FLOOR_S)
        deadline = time.monotonic() + timeout
        names = self.fleet.names("generator")
        while any(progress.generator_versions.get(n, -1) < final for n in names):
            if time.monotonic() > deadline:
                log.warning(
                    "generators still serve %s, not version %d, after %.0f s",
                    progress.generator_versions,
                    final,
                    timeout,
                )
                return
            self.pump.next(deadline + 1, "generators to load the final weights", wait=0.2)
