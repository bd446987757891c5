"""The controller: prepares the model, starts every component, watches them, stops them in
dataflow order so nothing is lost, and writes ``summary.json``.

``Controller`` composes parts that each own one job and the state that goes with it:

- ``preparation``: the run directory, the starting model, the children's environment;
- ``commands``: commands to the processes, resent until answered;
- ``events``: the one event loop (``EventPump``) and the routing of each event to its owners;
- ``reports``: what each process last said, its final report, how far training got;
- ``lifecycle`` and ``stopping``: start, train, stop in dataflow order, restore;
- ``checkpointing``: the two-phase commit of checkpoints and the restore point;
- ``supervision``: what happens when a process dies;
- ``evaluation``: held-out evaluation rounds by the generators;
- ``summary``: ``summary.json``.

A run stopped before its end (Ctrl-C; SIGTERM, turned into the same; an abort) ends with a
``stop`` line in the ledger, written once every process has exited, and a summary of what is
true of it (``write_stopped_summary``): its groups without an outcome were in flight at the
stop, and a resume sends them again.

Nothing waits forever: start-up, steps and shutdown each have a timeout that scales with the
model (the size of its weights, the run's measured step and publication times:
``asyncrl.controller.watchdog``); when one passes, the controller logs what every process last
said and aborts the run (stopping only its own children).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config import RunConfig
from asyncrl.controller.checkpointing import CheckpointCoordinator
from asyncrl.controller.commands import CommandSender
from asyncrl.controller.evaluation import Evaluations
from asyncrl.controller.events import EventPump, EventRouter
from asyncrl.controller.lifecycle import Lifecycle, stop_on_sigterm
from asyncrl.controller.phases import PhaseClock
from asyncrl.controller.preparation import (
    child_env,
    evaluate,
    prepare_model,
    prepare_run_dir,
    remove_short_tmp,
    resume_run_dir,
)
from asyncrl.controller.reports import ProcessReports, TrainingProgress
from asyncrl.controller.summary import resource_figures, write_stopped_summary, write_summary
from asyncrl.controller.supervision import Supervisor
from asyncrl.controller.watchdog import StallWatch
from asyncrl.fleet import malloc_trim
from asyncrl.fleet.launcher import controller_host, make_fleet
from asyncrl.fleet.local import ProcessFleet
from asyncrl.observability.procmem import MemoryWatch
from asyncrl.observability.progress import RunProgress
from asyncrl.rewards.evaluation import EvalScorer, eval_reward_specs
from asyncrl.rundir.ledger import LedgerWriter
from asyncrl.tasks.eval_sets import load_eval_prompts
from asyncrl.tasks.heldout import HeldOutEvaluator
from asyncrl.weights.timeline import PublicationTimeline
from asyncrl.wire import security
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.sockets import EvalRequestSender, Publisher, StreamReceiver

if TYPE_CHECKING:
    from asyncrl.fleet.ray_cluster import RayFleet

log = logging.getLogger("asyncrl")


class Controller:
    """Runs one training job: starts, checkpoints, supervises and stops it.

    ``resume=True`` continues the run in ``run.root/run.name`` from its newest verified
    checkpoint (or from its start when it has none) instead of starting a new one.

    While ``run()`` goes, another thread may read ``progress`` (steps seen, the learner's last
    report), ``supervisor`` (``training``, restarts due, deaths) and, once started, ``fleet``.
    """

    def __init__(self, cfg: RunConfig, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.run_dir = resume_run_dir(cfg) if resume else prepare_run_dir(cfg)
        self.console = RunProgress(cfg, self.run_dir)  # console and step loggers
        self.ledger = LedgerWriter(self.run_dir, "controller", cfg.checkpoint.ledger_segment_bytes)
        self.reports = ProcessReports()
        self.progress = TrainingProgress()
        self.supervisor = Supervisor(cfg.supervision, self.run_dir, self.reports, self.progress)
        self.timeline = PublicationTimeline()  # publication-to-served seconds per version and generator
        self.memory = MemoryWatch(every_s=1.0)  # the run's total RSS and the machine's available memory
        self.phases = PhaseClock()  # where the wall time goes; restarted when run() starts
        run = cfg.run
        self.watch = StallWatch(run.stall_factor, run.stall_timeout_s, run.stall_cap_s, run.first_step_timeout_s)
        self.fleet: ProcessFleet | RayFleet | None = None
        """The run's processes, once ``run()`` has started them."""
        self.checkpoints: CheckpointCoordinator | None = None
        """The checkpoint commit, once ``run()`` has opened the control socket."""

    def run(self) -> dict:
        """Prepare, start, train, stop; returns the summary (also in ``RUN_DIR/summary.json``)."""
        cfg = self.cfg
        t0 = time.monotonic()
        self.phases = PhaseClock(t0)
        simulated = cfg.simulation.learner is not None
        # Who evaluates (asyncrl.tasks.heldout): the generators' engines, while they serve the weights;
        # Hugging Face on this CPU only when asked (eval.engine: hf); nobody without a model.
        by_generators = cfg.eval.engine == "generators" and (
            (not simulated and cfg.simulation.generator is None)
            or (cfg.simulation.evaluate and cfg.simulation.generator is not None)
        )
        by_hf = not simulated and cfg.eval.engine == "hf"
        model_dir, eval_before = self._starting_model(simulated, by_hf)
        security.configure(cfg.security)  # before the first socket: CURVE and size limits
        endpoints = Endpoints.allocate(controller_host(cfg.launcher))
        endpoints.save(self.run_dir)
        events = StreamReceiver(endpoints.events, name="controller.events", hwm=10_000)
        commands = CommandSender(Publisher(endpoints.control, name="controller.control"))
        eval_requests = EvalRequestSender(endpoints.evals)
        heldout = scorer = None
        if by_generators:  # answers scored by the run's own rewards, here (asyncrl.rewards.evaluation)
            prompts, sets = load_eval_prompts(cfg, model_dir)
            scorer = EvalScorer(eval_reward_specs(cfg), cfg.task.metadata_by_task())
            heldout = HeldOutEvaluator(
                cfg.eval,
                prompts,
                eval_requests,
                scorer,
                sets,
                seed=cfg.run.seed,
                episodes=cfg.plays_episodes,
            )
        evaluations = Evaluations(cfg.eval, cfg.learner.total_steps, self.run_dir, self.console, heldout, eval_before)
        self.fleet = make_fleet(cfg, self.run_dir, model_dir, child_env(self.run_dir))
        self.console.watch(self.fleet, eval_before)
        lifecycle = self._assemble(events, commands, evaluations)
        self.phases.lap("prepare")
        rl_start = time.monotonic()
        cpu_start = time.process_time()
        restore_sigterm = stop_on_sigterm()
        trimmer = malloc_trim.start("controller", cfg.run.malloc_trim_s)  # as in every process it starts
        stopped: BaseException | None = None
        try:
            evaluate_first = heldout is not None and cfg.eval.before and not self.resume
            lifecycle.start_all(lifecycle.restore_point() if self.resume else None, evaluate_first=evaluate_first)
            if not self.resume:  # None while the round runs beside training: its end writes its score
                (self.run_dir / "eval_before.json").write_text(json.dumps(evaluations.before))
            lifecycle.train()
            lifecycle.stop_in_order()
        except BaseException as e:
            stopped = e
            self.console.close()
            lifecycle.dump_state()
            raise
        finally:
            restore_sigterm()
            if trimmer is not None:
                trimmer.stop()
            self.fleet.terminate()
            if stopped is not None:  # after every process exited: their last lines come before it
                self._record_stop(stop_reason(stopped), time.monotonic() - t0)
            remove_short_tmp(self.run_dir)
            events.close()
            commands.close()
            eval_requests.close()
            if scorer is not None:
                scorer.close()
            self.ledger.close()
        rl_wall_s = time.monotonic() - rl_start - evaluations.blocking_s
        controller_cpu_s = time.process_time() - cpu_start
        if by_hf and cfg.eval.after:
            evaluations.after = evaluate(cfg, self.run_dir / "final")
        if evaluations.after is not None:
            log.info("held-out exact match after RL: %.3f (before %s)", evaluations.after, evaluations.before)
        finals = self.reports.finals
        summary = write_summary(
            self.run_dir,
            cfg.sampling.n,
            finals,
            self.progress,
            evaluations,
            self.supervisor,
            self.checkpoints.committed,
            self.resume,
            rl_wall_s=rl_wall_s,
            controller_cpu_s=controller_cpu_s,
            total_wall_s=time.monotonic() - t0,
            resources=resource_figures(finals, self.memory, self.progress, self.timeline),
            phases=self.phases,
        )
        self.console.close(summary)
        return summary

    def _record_stop(self, reason: str, total_wall_s: float) -> None:
        """The ledger's ``stop`` line and the stopped run's summary, with its verdict in the log."""
        version = self.progress.version
        self.ledger.write("stop", reason=reason, version=version)
        summary = write_stopped_summary(
            self.run_dir,
            self.cfg.sampling.n,
            reason,
            self.progress,
            self.supervisor,
            self.checkpoints.committed,
            total_wall_s=total_wall_s,
        )
        ledger = summary["ledger"]
        log.warning(
            "run stopped (%s) after version %s: ledger: %d samples trained, %d dropped, %d in flight at the "
            "stop (sent again on resume), %d lost, %d trained twice; newest checkpoint %s; "
            "continue with: asyncrl train --resume %s",
            reason,
            version,
            ledger["trained"],
            sum(ledger["dropped"].values()),
            ledger["in_flight_at_stop"],
            ledger["lost"],
            ledger["trained_twice"],
            self.checkpoints.committed[-1] if self.checkpoints.committed else "none (a resume starts over)",
            self.run_dir,
        )

    def _starting_model(self, simulated: bool, by_hf: bool) -> tuple[Path, float | None]:
        """The model the run starts from, and its held-out score when Hugging Face scores it here
        (a resumed run reads both back from its run directory)."""
        cfg = self.cfg
        if self.resume:
            model_dir = Path((self.run_dir / "model_dir").read_text().strip())
            return model_dir, json.loads((self.run_dir / "eval_before.json").read_text())
        model_dir = Path("none") if simulated and cfg.simulation.generator else prepare_model(cfg, self.run_dir)
        (self.run_dir / "model_dir").write_text(str(model_dir.resolve()) + "\n")
        eval_before = evaluate(cfg, model_dir) if by_hf and cfg.eval.before else None
        return model_dir, eval_before

    def _assemble(self, events: StreamReceiver, commands: CommandSender, evaluations: Evaluations) -> Lifecycle:
        """Wire the parts around the fleet: the checkpoint commit, the event routing, the event
        loop and its duties, and the lifecycle that drives them."""
        cfg, fleet = self.cfg, self.fleet
        self.checkpoints = checkpoints = CheckpointCoordinator(cfg, self.run_dir, commands)
        router = EventRouter(
            self.run_dir,
            self.progress,
            checkpoints,
            commands,
            self.supervisor,
            evaluations,
            self.timeline,
            self.console,
        )

        def supervise() -> None:
            self.supervisor.check_joined(self.reports, commands)
            why = self.supervisor.check(fleet, commands)
            if why is not None:
                lifecycle.restore(why)

        def poll_evaluations() -> None:
            evaluations.poll(cfg.run.num_generators + self.reports.count_joined("generator"))

        def sample_memory() -> None:
            if isinstance(fleet, ProcessFleet):  # local children: their /proc is ours to read
                self.memory.sample({name: fleet.pid(name) for name in fleet.procs})

        pump = EventPump(
            events,
            fleet,
            self.reports,
            router.route,
            duties=[supervise, commands.resend, checkpoints.expire, poll_evaluations, sample_memory],
            on_eval_result=evaluations.answer,
        )
        lifecycle = Lifecycle(
            cfg,
            self.run_dir,
            fleet,
            commands,
            pump,
            self.reports,
            self.progress,
            self.supervisor,
            checkpoints,
            evaluations,
            self.watch,
            self.timeline,
            self.ledger,
            self.phases,
        )
        return lifecycle


def stop_reason(error: BaseException) -> str:
    """Why the run stopped before its end, for the ledger's ``stop`` line and the summary."""
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C has no message; SIGTERM's names the signal
        return f"interrupted ({error.args[0] if error.args else 'Ctrl-C'})"
    return f"aborted: {type(error).__name__}: {error}"
