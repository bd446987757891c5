"""The phases of a run, in dataflow order: start every component and say go, train until the
learner's last step under the stall watchdog, stop stage by stage so nothing is lost; and the
restore of the whole run from its last checkpoint when supervision asks for it.

Start: every process reports ready, the controller says go and the dispatcher starts handing
out prompts; the generators score the held-out set with the weights they started with
(``eval_before``), beside the first learner steps (``eval.overlap_before``: they apply no
publication until that round is answered) or, without overlap, before go. Stop: the dispatcher stops, every generator finishes the batch it is sampling and loads
the final weights (so each reports serving the final version) and scores the held-out set
(``eval_after``), the generators stop, then the reward workers drain their input, then the
buffer takes the rest and reconciles, then the learner exits. Each stage reports its final
counters, from which ``asyncrl.controller.accounting.summarize`` checks that every sample is
accounted for.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.controller.checkpointing import CheckpointCoordinator, restore_point
from asyncrl.controller.commands import CommandSender
from asyncrl.controller.errors import RunError
from asyncrl.controller.evaluation import Evaluations
from asyncrl.controller.events import EventPump
from asyncrl.controller.phases import PhaseClock
from asyncrl.controller.preparation import startup_bound
from asyncrl.controller.reports import ProcessReports, TrainingProgress
from asyncrl.controller.stopping import Stopper
from asyncrl.controller.supervision import Supervisor
from asyncrl.controller.watchdog import StallWatch
from asyncrl.fleet.gpu_plan import gpu_envs
from asyncrl.fleet.launcher import learner_rank_env, process_names, run_roles
from asyncrl.observability.scrape import write_scrape_config
from asyncrl.roles import ROLE_NAMES
from asyncrl.rundir.ledger import LedgerWriter
from asyncrl.weights.timeline import PublicationTimeline
from asyncrl.wire.endpoints import free_ports
from asyncrl.wire.messages import (
    CheckpointPartEvent,
    Event,
    GoCommand,
    ReadyEvent,
    ReleaseWeightsCommand,
    StepEvent,
)

log = logging.getLogger("asyncrl")

GO_REPEATS = 10
"""Times the first "go" is sent, 10 ms apart: PUB drops it for a subscriber not yet connected."""
GO_EVERY_S = 1.0
"""While training, "go" is sent again this often: a restarted process waits for go, too."""


class Lifecycle:
    """Starts, trains, stops and restores the run's processes; owns no state of its own but the
    parts it drives."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        fleet,
        commands: CommandSender,
        pump: EventPump,
        reports: ProcessReports,
        progress: TrainingProgress,
        supervisor: Supervisor,
        checkpoints: CheckpointCoordinator,
        evaluations: Evaluations,
        watch: StallWatch,
        timeline: PublicationTimeline,
        ledger: LedgerWriter,
        phases: PhaseClock,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.fleet = fleet
        self.commands = commands
        self.pump = pump
        self.reports = reports
        self.progress = progress
        self.supervisor = supervisor
        self.checkpoints = checkpoints
        self.evaluations = evaluations
        self.watch = watch
        self.timeline = timeline
        self.ledger = ledger
        self.phases = phases
        self.stopper = Stopper(fleet, commands, pump, reports, watch)
        self.gpu_envs = gpu_envs(cfg)  # checked and logged before anything starts; a restore reuses it
        self.starts = 0
        """Calls of ``start_all`` so far (a restore during one starts another)."""
        self.go = GoCommand()
        """The go sent (again every ``GO_EVERY_S``): while the round before RL runs beside
        training, one that holds the generators' starting weights (``eval.overlap_before``)."""
        if evaluations is not None:  # a lifecycle driven without evaluations (tests) has none to hear
            evaluations.on_before = self._before_answered

    def start_all(self, checkpoint: Path | None, evaluate_first: bool = False) -> None:
        """Start every component (from ``checkpoint`` when given) and say go once all are ready;
        with ``evaluate_first``, the generators first score the held-out set with the weights
        they serve (``eval_before``)."""
        cfg, fleet = self.cfg, self.fleet
        # Supervised from here: a death while starting or evaluating is handled as in training. A
        # restore during this start starts everything again itself; this call then has no more to do.
        self.supervisor.supervising = True
        self.starts += 1
        start = self.starts
        env = {"ASYNCRL_RESUME": str(checkpoint) if checkpoint is not None else ""}
        for r in run_roles(cfg):  # asyncrl.roles: the start order
            names = process_names(cfg, r.name)
            role_envs = [env] * len(names)
            if r.name == "learner":  # one rendezvous port, free now, for the group
                role_envs = [{**env, **rank} for rank in learner_rank_env(len(names), free_ports(1)[0])]
            for name, role_env in zip(names, role_envs):
                fleet.start(r.name, name, {**role_env, **self.gpu_envs.get(name, {})})
        ready = set()
        deadline = time.monotonic() + startup_bound(cfg, fleet.model_dir)
        while len(ready) < len(fleet.procs):
            ev = self.pump.next(deadline, "every process to report ready")
            if self.starts != start:
                return
            if isinstance(ev, ReadyEvent):
                ready.add(ev.source)
                self.phases.part("start", ev.source, time.monotonic() - self.phases.mark)
        log.info("all %d processes ready: %s", len(ready), ", ".join(sorted(ready)))
        write_scrape_config(self.run_dir)
        self.phases.lap("start")
        self.go = GoCommand()
        if evaluate_first and cfg.eval.overlap_before:  # beside the first steps, on the starting weights
            self.go = GoCommand(hold_weights_s=self.evaluations.start_before(cfg.run.num_generators))
        elif evaluate_first:
            self.evaluations.run_round("before", 0, self.pump.next)
            if self.starts != start:
                return
            self.phases.lap("eval_before")
        for _ in range(GO_REPEATS):
            self.commands.broadcast(self.go)
            time.sleep(0.01)
        self.progress.go_at = time.monotonic()

    def train(self) -> None:
        """Until the learner's last step (and the checkpoint it may be writing), with the stall
        watchdog of ``asyncrl.controller.watchdog``: its bound grows with the slowest interval between steps."""
        self.supervisor.training = True
        last_go = time.monotonic()
        self.watch.progress(measure=False)  # from go: the first interval is the first step's
        warned = False
        while self.progress.learner_done is None or self.checkpoints.pending is not None:
            ev = self.pump.next(None, "the learner's next step")
            if isinstance(ev, StepEvent | ReadyEvent | CheckpointPartEvent):
                # a restarted process's "ready" restarts the clock but measures no step
                self.watch.progress(measure=not isinstance(ev, ReadyEvent) and ev.role == "learner")
                warned = False
            state = self.watch.state()
            if state == "stalled":
                self.log_waits(self.watch.waited())
                raise RunError(
                    f"timed out waiting for the learner's next step: none for {self.watch.waited():.0f} s, "
                    f"past the stall bound of {self.watch.bound():.0f} s ({self.bound_rule()})"
                )
            if state == "warn" and not warned:
                warned = True  # the watchdog: say what everyone waits for long before giving up
                self.log_waits(self.watch.waited())
            if time.monotonic() - last_go > GO_EVERY_S:
                self.commands.broadcast(self.go)
                last_go = time.monotonic()
        self.supervisor.training = self.supervisor.supervising = False

    def _before_answered(self, record: dict) -> None:
        """The round before RL ended (``Evaluations.on_before``): its score kept for a resume and,
        if it ran beside training, the generators' starting weights released."""
        (self.run_dir / "eval_before.json").write_text(json.dumps(record["exact_match"]))
        if self.go.hold_weights_s > 0:
            self.go = GoCommand()
            for _ in range(3):  # the subscribers are connected by now; a repeat costs nothing
                self.commands.broadcast(ReleaseWeightsCommand(round="before"))

    def stop_in_order(self) -> None:
        """Stop stage by stage in dataflow order, each one's final reports in before the next."""
        self.phases.lap("train")
        self.stopper.stop(["dispatcher"])  # first: no more prompts
        self.stopper.await_final_weights(self.progress, self.timeline)
        self.phases.lap("drain")
        if self.evaluations.heldout is not None and self.cfg.eval.after:  # every generator serves the final weights
            record = self.evaluations.run_round("after", self.progress.final_version(), self.pump.next)
            self.evaluations.after = record["exact_match"]
            self.phases.lap("eval_after")
        for name in ROLE_NAMES:  # the rest of the dataflow, in order: each drains into the next
            if name != "dispatcher":
                stage_start = time.monotonic()
                self.stopper.stop([name])
                self.phases.part("stop", name, time.monotonic() - stage_start)
        self.phases.lap("stop")

    def restore_point(self) -> Path | None:
        """The checkpoint to start from (``asyncrl.controller.checkpointing.restore_point``)."""
        return restore_point(self.run_dir, self.ledger)

    def restore(self, why: str) -> None:
        """Stop every process and start them all again from the last checkpoint."""
        log.error("%s: restoring the whole run from its last checkpoint", why)
        self.fleet.terminate()
        self.supervisor.on_restore()
        self.reports.finals.clear()
        self.progress.generator_versions.clear()
        self.progress.learner_done = None
        self.commands.forget()
        self.checkpoints.abandon()
        self.start_all(self.restore_point())

    def bound_rule(self) -> str:
        """The stall bound's rule, with the figures it is computed from."""
        run, slowest = self.cfg.run, self.watch.slowest
        measured = "no step measured yet" if slowest is None else f"the slowest interval so far {slowest:.0f} s"
        return (
            f"{run.stall_factor:g} x {measured}, within [{run.stall_timeout_s:g}, {run.stall_cap_s:g}] s: "
            "run.stall_factor, run.stall_timeout_s, run.stall_cap_s"
        )

    def log_waits(self, stalled_s: float) -> None:
        """The watchdog's report: each process's last word and what it waits for."""
        log.warning(
            "no learner step for %.0f s (the run stops at %.0f s: %s); each process's last word:",
            stalled_s,
            self.watch.bound(),
            self.bound_rule(),
        )
        now, dead = time.monotonic(), self.fleet.dead()
        for name in sorted(self.fleet.procs):
            ev = self.reports.last_event.get(name)
            alive = name not in dead
            said = f"{ev.type} {now - self.reports.last_event_at[name]:.0f} s ago" if ev else "nothing yet"
            log.warning("  %s (%s): %s%s", name, "alive" if alive else "exited", said, waits_for(ev))

    def dump_state(self) -> None:
        log.error("run aborted; last event of each process:")
        for name in sorted(self.fleet.procs):
            log.error("  %s: %s", name, self.reports.last_event.get(name, "(nothing received)"))


def waits_for(ev: Event | None) -> str:
    """What a process waits for, read from its last event."""
    if ev is None:
        return " (starting)"
    waits = {
        "step": " (learner: waiting for its next batch from the buffer)",
        "version": " (generator: sampling, or waiting for prompts within the staleness budget)",
        "ready": " (waiting for work)",
        "checkpoint_part": " (writing or waiting on a checkpoint)",
    }
    return waits.get(ev.type, "")


def stop_on_sigterm():
    """Make SIGTERM (a service manager's stop, ``kill PID``) stop the run as Ctrl-C does: the
    processes are stopped and the run's state dumped, instead of the controller vanishing and
    leaving its children behind. Returns what puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals reach the main thread only; its owner decides

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)
