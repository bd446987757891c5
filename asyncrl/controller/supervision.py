"""What the controller does when a component process dies, by the rules of
``asyncrl.fleet.supervision``: restart a stateless one after its backoff and have the dispatcher
hand out again what it may have held, or have the whole run restored from its last checkpoint.
A process that joined by address (``asyncrl.fleet.join``) is not this controller's to restart
or watch by PID: its silence past ``supervision.joined_timeout_s`` (it sends heartbeats) is taken
for its death, what it held is handed out again, and the death is reported like any other.

Supervision acts from the first start of the processes to the learner's last step
(``supervising``): a death during start-up or the evaluation before RL is handled as one during
training. A death during the stop is an error, and so is one past ``supervision.max_restarts``,
and one whose reported error is the same as that of the same process's death before it (after a
restart): a deterministic failure (a bad config, weights that never pass the probe) stops the run
with its reason instead of looping through restarts.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.controller.errors import RunError
from asyncrl.controller.reports import ProcessReports, TrainingProgress
from asyncrl.fleet.config import SupervisionConfig
from asyncrl.fleet.supervision import Backoff
from asyncrl.wire.messages import ErrorEvent, RequeueCommand

if TYPE_CHECKING:
    from asyncrl.controller.commands import CommandSender
    from asyncrl.fleet.local import ProcessFleet
    from asyncrl.fleet.ray_cluster import RayFleet

log = logging.getLogger("asyncrl")

RESTORED_ROLES = ("learner", "dispatcher")
"""Roles whose death restores the whole run: their state is in checkpoints only."""
REQUEUE_SCOPE = {"generator": "generator", "reward": "in_flight", "buffer": "buffered"}
"""What the dispatcher hands out again when a process of the role dies (its ``requeue`` scope)."""


class Supervisor:
    """Owns the restarts scheduled, each component's backoff, the deaths seen and the restores."""

    def __init__(self, cfg: SupervisionConfig, run_dir: Path, reports: ProcessReports, progress: TrainingProgress):
        self.cfg = cfg
        self.run_dir = run_dir
        self.reports = reports
        self.progress = progress
        self.backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self.supervising = False
        """True from the first start to the learner's last step: supervision acts; otherwise a death is an error."""
        self.training = False
        """True from go to the learner's last step."""
        self.errors: dict[str, str] = {}
        """Name -> the error it reported last, since its last death (``error_shape``)."""
        self.death_errors: dict[str, str | None] = {}
        """Name -> the error it reported before its last death that reported one."""
        self.restart_due: dict[str, float] = {}
        """Name -> monotonic time of its scheduled restart."""
        self.deaths: list[dict] = []
        self.restores = 0
        self.silent: set[str] = set()
        """Joined processes taken for dead (until heard from again)."""

    def check(self, fleet: ProcessFleet | RayFleet, commands: CommandSender) -> str | None:
        """Act on deaths: schedule restarts (and requeues), start what is due. Returns why the
        whole run must be restored from its last checkpoint, or None."""
        dead = {n: rc for n, rc in fleet.dead().items() if n not in self.reports.finals and n not in self.restart_due}
        for name, rc in dead.items():
            role = fleet.roles[name]
            self.deaths.append(
                {"name": name, "role": role, "exit_code": rc, "t": time.monotonic() - self.progress.go_at}
            )
            error = self.errors.pop(name, None)
            self.refuse_repeat(name, error, self.death_errors.get(name))
            if error is not None:  # else kept: an error reported late is held against the one before
                self.death_errors[name] = error
            if not self.supervising or not self.cfg.restart:
                raise RunError(f"process {name} died (exit code {rc}); see {self.run_dir / 'logs' / (name + '.log')}")
            if self.backoff.count(name) >= self.cfg.max_restarts:
                raise RunError(
                    f"process {name} died (exit code {rc}) after {self.cfg.max_restarts} restarts: giving up"
                )
            if role in RESTORED_ROLES:
                if not self.cfg.restore_on_crash:
                    raise RunError(f"{name} died (exit code {rc}) and supervision.restore_on_crash is off")
                self.backoff.next(name)
                return f"{name} died (exit code {rc})"
            delay = self.backoff.next(name)
            log.warning("%s died (exit code %d): restarting it in %.1f s", name, rc, delay)
            self.restart_due[name] = time.monotonic() + delay
            self.progress.generator_versions.pop(name, None)
            scope = REQUEUE_SCOPE.get(role)
            if scope is not None:
                generator = name if role == "generator" else None
                ack = f"requeue@{name}@{time.monotonic()}"
                commands.send("dispatcher", RequeueCommand(scope=scope, generator=generator), ack=ack)
        now = time.monotonic()
        for name, due in list(self.restart_due.items()):
            if now >= due:
                del self.restart_due[name]
                fleet.restart(name, {"ASYNCRL_RESUME": ""})  # stateless, or the buffer started empty
        return None

    def check_joined(self, reports: ProcessReports, commands: CommandSender, now: float | None = None) -> None:
        """Take a joined process silent for ``joined_timeout_s`` for dead (while the run trains):
        report it, leave it out of the stop's wait, and have the dispatcher hand out again what
        it may have held. One heard from again is back in the run (what it still held then
        arrives as copies, which the ids keep from being trained twice)."""
        now = time.monotonic() if now is None else now
        for name in [n for n in self.silent if now - reports.last_event_at.get(n, 0.0) < self.cfg.joined_timeout_s]:
            self.silent.discard(name)
            log.warning("%s, taken for dead, is heard from again", name)
        if not self.supervising:
            return
        for name, role in list(reports.joined.items()):
            silent_s = now - reports.last_event_at.get(name, now)
            if name in reports.finals or silent_s < self.cfg.joined_timeout_s:
                continue
            self.silent.add(name)
            del reports.joined[name]  # not waited for at the stop; an event brings it back
            self.deaths.append(
                {"name": name, "role": role, "exit_code": None, "joined": True, "t": now - self.progress.go_at}
            )
            log.error(
                "%s joined the run by address and has not been heard from for %.0f s: taken for dead", name, silent_s
            )
            scope = REQUEUE_SCOPE.get(role)
            if scope is not None:
                generator = name if role == "generator" else None
                commands.send(
                    "dispatcher", RequeueCommand(scope=scope, generator=generator), ack=f"requeue@{name}@{now}"
                )

    def on_error(self, ev: ErrorEvent) -> None:
        """A process reported a failure: while supervision acts, its exit is what counts (unless
        it failed the same way before its last restart); otherwise the run stops."""
        if not (self.supervising and self.cfg.restart):
            raise RunError(f"{ev.source} failed: {ev.error}")
        log.error("%s failed: %s", ev.source, ev.error)
        self.errors[ev.source] = error_shape(ev.error)
        self.refuse_repeat(ev.source, self.errors[ev.source], self.death_errors.get(ev.source), ev.error)

    def refuse_repeat(self, name: str, error: str | None, before: str | None, said: str | None = None) -> None:
        """Stop the run if ``name`` failed with the error it failed with before its last restart."""
        if error is not None and error == before:
            raise RunError(
                f"{name} failed again after a restart with the same error, so another restart will not help: "
                f"{said or error}; see {self.run_dir / 'logs' / (name + '.log')}"
            )

    def on_restore(self) -> None:
        """The whole run restarts from a checkpoint: no restart is due any more."""
        self.restores += 1
        self.restart_due.clear()


def error_shape(error: str) -> str:
    """An error message with its numbers masked: the same failure at another version, after
    another number of seconds or with other figures is the same failure.

    >>> error_shape("WeightSyncError: probe after applying version 2: differ by 0.0732 > 0.05")
    'WeightSyncError: probe after applying version #: differ by # > #'
    """
    return re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "#", error)
