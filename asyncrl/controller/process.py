"""The controller: prepares the model, starts every component as a local process, watches them,
stops them in dataflow order so nothing is lost, and writes ``summary.json``.

Start: every process reports ready, the generators score the held-out set with the weights they
serve (``eval_before``, ``asyncrl.tasks.heldout``), then the controller says go and the dispatcher starts
handing out prompts. During training the generators score it again every ``eval.every_versions``
versions, between their batches. Stop order: when the learner has taken its last step, the
dispatcher stops, every generator finishes the batch it is sampling and loads the final weights
(so each reports serving the final version) and scores the held-out set (``eval_after``), the
generators stop, then the reward workers drain their
input, then the buffer takes the rest and reconciles, then the learner exits. Each stage reports
its final counters, from which ``accounting.summarize`` checks that every sample is accounted for.

Nothing waits forever: start-up, steps and shutdown each have a timeout that scales with the
model (the size of its weights, the run's measured step and publication times: ``asyncrl.controller.watchdog``);
when one passes, the controller logs what every process last said and aborts the run (stopping only
its own children).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import yaml

from asyncrl.config import RunConfig, dump_config
from asyncrl.controller.accounting import summarize
from asyncrl.controller.watchdog import StallWatch
from asyncrl.fleet.launcher import controller_host, make_fleet
from asyncrl.fleet.local import ProcessFleet
from asyncrl.fleet.supervision import Backoff
from asyncrl.generators.multiplex import generator_process_names
from asyncrl.observability.metrics import WEIGHT_SERVED_SECONDS
from asyncrl.observability.procmem import MemoryWatch, peak_rss_bytes
from asyncrl.observability.progress import RunProgress
from asyncrl.rundir.checkpoints import commit, discard_staging, latest_checkpoint, staging_dir
from asyncrl.rundir.ledger import LedgerWriter, reconcile_ledger
from asyncrl.tasks.heldout import HeldOutEvaluator
from asyncrl.weights.timeline import PublicationTimeline, describe
from asyncrl.wire import security
from asyncrl.wire.endpoints import Endpoints, free_ports
from asyncrl.wire.sockets import EvalRequestSender, Publisher, StreamReceiver

log = logging.getLogger("asyncrl")

JOINABLE = ("generator", "reward")
"""Roles a process can join a running run in by address (``asyncrl generator|reward-worker --connect``)."""
JOINED_STOP_S = 30.0
"""Seconds the stop waits for a joined process's final report once the run's own are in."""
STOP_FLOOR_S = 120.0
"""Least seconds a stage's stop waits for its final reports (else the stall bound, if longer)."""
FINAL_WEIGHTS_FLOOR_S = 60.0
"""Least seconds the stop waits for every generator to serve the final version."""


class RunError(RuntimeError):
    """The run could not finish: a process died, stalled, or never started."""


def child_env(run_dir: Path) -> dict[str, str]:
    """Environment of every component: one math thread each, offline, temp files in the run."""
    tmp = run_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TORCHDYNAMO_DISABLE="1",  # vLLM's CPU backend otherwise spends 15-20 s in g++ at start
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine in the generator's own process: 8 s, 1 GiB
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # two engines on one box must not pin to the same core
        DS_ACCELERATOR="cpu" if not _has_cuda() else env.get("DS_ACCELERATOR", "cuda"),
        TMPDIR=str(tmp),
        PYTHONUNBUFFERED="1",
    )
    return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def startup_bound(cfg: RunConfig, model_dir: Path) -> float:
    """Seconds every process has to report ready: ``run.startup_timeout_s`` plus
    ``run.startup_s_per_gib`` per GiB of the model's weight files (none for a simulated run)."""
    weights = 0
    if model_dir.is_dir():
        weights = sum(p.stat().st_size for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    return cfg.run.startup_timeout_s + cfg.run.startup_s_per_gib * weights / (1 << 30)


def _waits_for(ev: dict | None) -> str:
    """What a process waits for, read from its last event."""
    if ev is None:
        return " (starting)"
    waits = {
        "step": " (learner: waiting for its next batch from the buffer)",
        "version": " (generator: sampling, or waiting for prompts within the staleness budget)",
        "ready": " (waiting for work)",
        "checkpoint_part": " (writing or waiting on a checkpoint)",
    }
    return waits.get(ev["type"], "")


def prepare_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.run.root) / cfg.run.name
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise RunError(f"run directory {run_dir} exists and run.overwrite is false")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir.resolve()


def resume_run_dir(cfg: RunConfig) -> Path:
    """The existing run directory to resume; its resolved config is rewritten with ``cfg``."""
    run_dir = (Path(cfg.run.root) / cfg.run.name).resolve()
    if not (run_dir / "config.yaml").exists():
        raise RunError(f"cannot resume {run_dir}: it has no config.yaml (is it a run directory?)")
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "summary.json").unlink(missing_ok=True)  # written again when the resumed run ends
    return run_dir


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The policy RL starts from: a given model, or the tiny model built here, warm-started by SFT."""
    from asyncrl.models.sft import run_sft
    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.tasks.prompts import load_run_prompts

    if cfg.model.path is not None:
        base = Path(cfg.model.path)
    else:
        base = build_tiny_model(cfg.model.tiny.model_copy(update={"seed": cfg.run.seed}), run_dir / "model" / "base")
        log.info("built the tiny model in %s", base)
    if not cfg.model.warm_start:
        return base
    warm = run_dir / "model" / "warm"
    stats = run_sft(base, load_run_prompts(cfg, "train", base), cfg.sft, warm)
    log.info("SFT warm start: %d steps, final loss %.3f, %.1f s", stats["steps"], stats["final_loss"], stats["seconds"])
    return warm


def evaluate(cfg: RunConfig, model_dir: Path) -> float:
    """``eval.engine: hf``: Hugging Face greedy decoding on this CPU in float32 (small models only)."""
    from asyncrl.models.hf_eval import evaluate_exact_match

    return evaluate_exact_match(
        model_dir, None, held_out_prompts(cfg, model_dir), max_new_tokens=cfg.eval.max_new_tokens
    )


def held_out_prompts(cfg: RunConfig, model_dir: Path) -> list:
    """The first ``eval.num_prompts`` of the task's test split, rendered and measured as the
    engines take them (``asyncrl.tasks.prompts.load_run_prompts``): what every evaluation scores."""
    from asyncrl.tasks.prompts import load_run_prompts

    return load_run_prompts(cfg, "test", model_dir)[: cfg.eval.num_prompts]


def write_scrape_config(run_dir: Path) -> Path:
    """``RUN_DIR/prometheus.yml``: a Prometheus scrape job over every process's metrics port."""
    targets = [
        {"targets": [f"127.0.0.1:{port.read_text().strip()}"], "labels": {"component": port.stem}}
        for port in sorted((run_dir / "metrics").glob("*.port"))
    ]
    scrape = {
        "scrape_configs": [{"job_name": f"asyncrl-{run_dir.name}", "scrape_interval": "5s", "static_configs": targets}]
    }
    path = run_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(scrape, sort_keys=False))
    return path


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


class Controller:
    """Runs one training job on this machine: starts, checkpoints, supervises and stops it.

    ``resume=True`` continues the run in ``run.root/run.name`` from its newest verified
    checkpoint (or from its start when it has none) instead of starting a new one.
    """

    def __init__(self, cfg: RunConfig, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.run_dir = resume_run_dir(cfg) if resume else prepare_run_dir(cfg)
        self.finals: dict[str, dict] = {}
        self.joined: dict[str, str] = {}  # processes that joined by address (not started here): name -> role
        self.last_event: dict[str, dict] = {}
        self.last_event_at: dict[str, float] = {}
        self.generator_versions: dict[str, int] = {}
        self.steps_seen = 0
        self.progress = RunProgress(cfg, self.run_dir)  # console and step loggers
        self.learner_done: dict | None = None
        self.go_at = self.done_at = 0.0  # monotonic times of "go" and of the learner's last step
        sup = cfg.supervision
        self.backoff = Backoff(sup.backoff_initial_s, sup.backoff_max_s)
        self.restart_due: dict[str, float] = {}  # name -> monotonic time of its scheduled restart
        self.deaths: list[dict] = []
        self.restores = 0
        self.training = False  # supervision acts while training; a death while stopping is an error
        self.checkpoint: dict | None = None  # the checkpoint being written: version, stage, deadline
        self.checkpoints: list[int] = []
        self.unacked: dict[str, dict] = {}  # command id -> command, resent until its effect is seen
        self.ledger = LedgerWriter(self.run_dir, "controller")
        self.timeline = PublicationTimeline()  # publication-to-served seconds per version and generator
        self.memory = MemoryWatch(every_s=1.0)  # the run's total RSS and the machine's available memory
        self.step_seconds: list[float] = []  # each learner step's step_s
        run = cfg.run
        self.watch = StallWatch(run.stall_factor, run.stall_timeout_s, run.stall_cap_s, run.first_step_timeout_s)
        self.heldout: HeldOutEvaluator | None = None  # evaluation by the generators (asyncrl.tasks.heldout)
        self.eval_before: float | None = None
        self.eval_after: float | None = None
        self.evals: list[dict] = []  # every evaluation's record, in order
        self.blocking_eval_s = 0.0  # seconds the RL phase stood still for eval_before / eval_after

    def run(self) -> dict:
        cfg = self.cfg
        t0 = time.monotonic()
        simulated = cfg.simulation.learner is not None
        # Who evaluates (asyncrl.tasks.heldout): the generators' engines, while they serve the weights;
        # Hugging Face on this CPU only when asked (eval.engine: hf); nobody without a model.
        by_generators = not simulated and cfg.eval.engine == "generators" and cfg.simulation.generator is None
        by_hf = not simulated and cfg.eval.engine == "hf"
        if self.resume:
            model_dir = Path((self.run_dir / "model_dir").read_text().strip())
            self.eval_before = json.loads((self.run_dir / "eval_before.json").read_text())
        else:
            model_dir = Path("none") if simulated and cfg.simulation.generator else prepare_model(cfg, self.run_dir)
            (self.run_dir / "model_dir").write_text(str(model_dir.resolve()) + "\n")
            if by_hf and cfg.eval.before:
                self.eval_before = evaluate(cfg, model_dir)
        security.configure(cfg.security)  # before the first socket: CURVE and size limits
        endpoints = Endpoints.allocate(controller_host(cfg.launcher))
        endpoints.save(self.run_dir)
        self.events = StreamReceiver(endpoints.events, name="controller.events", hwm=10_000)
        self.control = Publisher(endpoints.control, name="controller.control")
        self.eval_requests = EvalRequestSender(endpoints.evals)
        if by_generators:
            self.heldout = HeldOutEvaluator(cfg.eval, held_out_prompts(cfg, model_dir), self.eval_requests)
        self.fleet = make_fleet(cfg, self.run_dir, model_dir, child_env(self.run_dir))
        self.progress.watch(self.fleet, self.eval_before)
        rl_start = time.monotonic()
        cpu_start = time.process_time()
        restore_sigterm = stop_on_sigterm()
        try:
            evaluate_first = self.heldout is not None and cfg.eval.before and not self.resume
            self._start_all(self._restore_point() if self.resume else None, evaluate_first=evaluate_first)
            if not self.resume:
                (self.run_dir / "eval_before.json").write_text(json.dumps(self.eval_before))
            self._train()
            self._stop_in_order()
        except BaseException:
            self.progress.close()
            self._dump_state()
            raise
        finally:
            restore_sigterm()
            self.fleet.terminate()
            self.events.close()
            self.control.close()
            self.eval_requests.close()
            self.ledger.close()
        rl_wall = time.monotonic() - rl_start - self.blocking_eval_s
        controller_cpu_s = time.process_time() - cpu_start
        if by_hf and cfg.eval.after:
            self.eval_after = evaluate(cfg, self.run_dir / "final")
        if self.eval_after is not None:
            log.info("held-out exact match after RL: %.3f (before %s)", self.eval_after, self.eval_before)
        summary = summarize(self.finals, rl_wall, self.eval_before, self.eval_after)
        summary["evals"] = self.evals
        summary["eval_prompts_answered"] = sum(
            f.get("eval_prompts", 0) for f in self.finals.values() if f["role"] == "generator"
        )
        summary["controller_cpu_s"] = controller_cpu_s
        summary["train_wall_s"] = self.done_at - self.go_at  # steady state: from go to the last step
        summary["total_wall_s"] = time.monotonic() - t0
        summary["generator_versions"] = self.generator_versions
        summary["checkpoints"] = self.checkpoints
        summary["deaths"] = self.deaths
        summary["restores"] = self.restores
        summary["ledger"] = reconcile_ledger(self.run_dir, cfg.sampling.n)
        summary.update(self._resource_figures())
        # Per-process counters cannot count what a killed process held; the ledger can, by id.
        summary["counters_reconcile"] = summary["reconciles"]
        ledger_ok = summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
        clean = not self.deaths and not self.resume
        summary["reconciles"] = ledger_ok and (summary["counters_reconcile"] or not clean)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.progress.close(summary)
        return summary

    # -- phases ---------------------------------------------------------------------------------

    def _start_all(self, checkpoint: Path | None, evaluate_first: bool = False) -> None:
        """Start every component (from ``checkpoint`` when given) and say go once all are ready;
        with ``evaluate_first``, the generators first score the held-out set with the weights
        they serve (``eval_before``)."""
        cfg, fleet = self.cfg, self.fleet
        env = {"ASYNCRL_RESUME": str(checkpoint) if checkpoint is not None else ""}
        fleet.start("buffer", "buffer", env)
        fleet.start("reward", "reward-0", env)
        fleet.start("dispatcher", "dispatcher", env)
        if cfg.algorithm.kl.enabled and cfg.algorithm.kl.reference == "process":
            fleet.start("reference", "reference", env)
        fleet.start(
            "learner",
            "learner",
            {
                **env,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_ports(1)[0]),
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
            },
        )
        for name in generator_process_names(cfg):  # several simulated engines may share one
            fleet.start("generator", name, env)
        ready = set()
        deadline = time.monotonic() + startup_bound(cfg, fleet.model_dir)
        while len(ready) < len(fleet.procs):
            ev = self._next_event(deadline, "every process to report ready")
            if ev and ev["type"] == "ready":
                ready.add(ev["source"])
        log.info("all %d processes ready: %s", len(ready), ", ".join(sorted(ready)))
        write_scrape_config(self.run_dir)
        if evaluate_first:
            record = self._evaluate_now("before", version=0)
            self.eval_before = record["exact_match"]
        for _ in range(10):  # PUB: repeat, so that no subscriber misses it
            self.control.send("control", {"command": "go"})
            time.sleep(0.01)
        self.go_at = time.monotonic()

    def _train(self) -> None:
        """Until the learner's last step (and the checkpoint it may be writing), with the stall
        watchdog of ``asyncrl.controller.watchdog``: its bound grows with the slowest interval between steps."""
        self.training = True
        last_go = time.monotonic()
        self.watch.progress(measure=False)  # from go: the first interval is the first step's
        warned = False
        while self.learner_done is None or self.checkpoint is not None:
            ev = self._next_event(None, "the learner's next step")
            if ev and ev["type"] in ("step", "ready", "checkpoint_part"):
                # a restarted process's "ready" restarts the clock but measures no step
                self.watch.progress(measure=ev["type"] != "ready" and ev.get("role") == "learner")
                warned = False
            state = self.watch.state()
            if state == "stalled":
                self._log_waits(self.watch.waited())
                raise RunError(
                    f"timed out waiting for the learner's next step: none for {self.watch.waited():.0f} s, "
                    f"past the stall bound of {self.watch.bound():.0f} s ({self._bound_rule()})"
                )
            if state == "warn" and not warned:
                warned = True  # the watchdog: say what everyone waits for long before giving up
                self._log_waits(self.watch.waited())
            if time.monotonic() - last_go > 1.0:  # a restarted process waits for go, too
                self.control.send("control", {"command": "go"})
                last_go = time.monotonic()
        self.training = False

    def _bound_rule(self) -> str:
        run, slowest = self.cfg.run, self.watch.slowest
        measured = "no step measured yet" if slowest is None else f"the slowest interval so far {slowest:.0f} s"
        return (
            f"{run.stall_factor:g} x {measured}, within [{run.stall_timeout_s:g}, {run.stall_cap_s:g}] s: "
            "run.stall_factor, run.stall_timeout_s, run.stall_cap_s"
        )

    def _stop_in_order(self) -> None:
        self._stop(["dispatcher"])
        self._await_final_weights()
        if self.heldout is not None and self.cfg.eval.after:  # every generator serves the final weights
            self.eval_after = self._evaluate_now("after", version=self.learner_done["version"])["exact_match"]
        for roles in (["generator"], ["reward"], ["buffer"], ["learner"], ["reference"]):
            self._stop(roles)

    def _stop(self, roles: list[str], timeout: float | None = None) -> None:
        """Stop ``roles`` and wait for each process's final report, at most ``timeout`` seconds
        (default: the stall bound, since a generator finishes the batch it samples, at least
        ``STOP_FLOOR_S``). A process that joined the run
        by address (``asyncrl reward-worker --connect``) is waited for too, up to
        ``JOINED_STOP_S``: stopping the next stage first would leave what it still forwards
        nowhere to go, and its counts out of the summary. It is not ours to watch exit."""
        names = [n for r in roles for n in self.fleet.names(r)]
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else max(STOP_FLOOR_S, self.watch.bound()))
        while True:
            joined = [n for n, role in self.joined.items() if role in roles and n not in self.finals]
            if all(n in self.finals for n in names) and self.fleet.exited(names):
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
            self.control.send("control", {"command": "stop", "roles": roles})
            self._next_event(deadline, f"{', '.join(roles)} to stop", wait=0.2)

    def _await_final_weights(self, timeout: float | None = None) -> None:
        """With no more prompts, every generator picks up the last published version: within
        ``timeout`` seconds, by default ``stall_factor`` × the longest publication-to-served time
        seen (at least ``FINAL_WEIGHTS_FLOOR_S``): a generator first finishes its batch."""
        final = self.learner_done["version"]
        if timeout is None:
            served = self.timeline.summary()["total_s"].get("max")
            timeout = self.watch.scaled(served, FINAL_WEIGHTS_FLOOR_S)
        deadline = time.monotonic() + timeout
        names = self.fleet.names("generator")
        while any(self.generator_versions.get(n, -1) < final for n in names):
            if time.monotonic() > deadline:
                log.warning(
                    "generators still serve %s, not version %d, after %.0f s", self.generator_versions, final, timeout
                )
                return
            self._next_event(deadline + 1, "generators to load the final weights", wait=0.2)

    # -- checkpoints ----------------------------------------------------------------------------

    def _on_checkpoint_part(self, ev: dict) -> None:
        """The learner saved its part at a version: ask the buffer, then the dispatcher, for theirs
        (in that order: see ``asyncrl.rundir.checkpoints``), then commit."""
        version, part = int(ev["version"]), ev["part"]
        stage = staging_dir(self.run_dir, version)
        if part == "learner":
            if self.checkpoint is not None:
                log.warning("checkpoint %d abandoned: the next one (%d) is due", self.checkpoint["version"], version)
                self._drop_checkpoint()
            self.checkpoint = {"version": version, "deadline": time.monotonic() + self.cfg.checkpoint.timeout_s}
            self._command("buffer", "checkpoint", dir=str(stage), version=version, ack=f"buffer@{version}")
        elif self.checkpoint is None or self.checkpoint["version"] != version:
            return  # a late answer about an abandoned checkpoint
        elif part == "buffer":
            self.unacked.pop(f"buffer@{version}", None)
            self._command("dispatcher", "checkpoint", dir=str(stage), version=version, ack=f"dispatcher@{version}")
        elif part == "dispatcher.json":
            self.unacked.pop(f"dispatcher@{version}", None)
            shutil.copy2(self.run_dir / "config.yaml", stage / "config.yaml")  # the resolved config it ran with
            path = commit(
                self.run_dir,
                version,
                ["learner", "buffer", "dispatcher.json", "config.yaml"],
                meta={"run": self.cfg.run.name, "samples_per_group": self.cfg.sampling.n},
                keep_last=self.cfg.checkpoint.keep_last,
            )
            self.checkpoints.append(version)
            self.checkpoint = None
            self._command("dispatcher", "checkpoint_committed", version=version)
            log.info("checkpoint committed: %s", path)

    def _drop_checkpoint(self) -> None:
        version = self.checkpoint["version"]
        for key in (f"buffer@{version}", f"dispatcher@{version}"):
            self.unacked.pop(key, None)
        shutil.rmtree(staging_dir(self.run_dir, version), ignore_errors=True)
        self.checkpoint = None

    def _restore_point(self) -> Path | None:
        """The newest verified checkpoint; writes the ledger's restore mark for it."""
        discard_staging(self.run_dir)
        path = latest_checkpoint(self.run_dir)
        if path is None:
            version = dispatched = 0
            log.warning("no checkpoint in %s: the run starts over", self.run_dir)
        else:
            state = json.loads((path / "dispatcher.json").read_text())
            version, dispatched = int(state["version"]), int(state["dispatched"])
            log.info("restoring the run from %s (version %d)", path, version)
        self.ledger.write("restore", version=version, dispatched=dispatched)
        return path

    # -- supervision ----------------------------------------------------------------------------

    def _command(self, role: str, command: str, ack: str | None = None, **fields) -> None:
        """Send a command to a role; with ``ack``, resend it until the answer clears that key."""
        body = {"command": command, "roles": [role], "id": ack or f"{command}@{time.monotonic()}", **fields}
        self.control.send("control", body)
        if ack is not None:
            self.unacked[ack] = {"body": body, "sent": time.monotonic()}

    def _resend(self) -> None:
        now = time.monotonic()
        for entry in self.unacked.values():
            if now - entry["sent"] > 0.5:
                self.control.send("control", entry["body"])
                entry["sent"] = now
        if self.checkpoint is not None and now > self.checkpoint["deadline"]:
            log.error(
                "checkpoint %d abandoned: no answer within %.0f s",
                self.checkpoint["version"],
                self.cfg.checkpoint.timeout_s,
            )
            self._drop_checkpoint()

    def _supervise(self) -> None:
        """Act on deaths: restart what can be restarted, requeue what it held, or restore the run."""
        dead = {n: rc for n, rc in self.fleet.dead().items() if n not in self.finals and n not in self.restart_due}
        for name, rc in dead.items():
            role = self.fleet.roles[name]
            sup = self.cfg.supervision
            self.deaths.append({"name": name, "role": role, "exit_code": rc, "t": time.monotonic() - self.go_at})
            if not self.training or not sup.restart:
                raise RunError(f"process {name} died (exit code {rc}); see {self.run_dir / 'logs' / (name + '.log')}")
            if self.backoff.count(name) >= sup.max_restarts:
                raise RunError(f"process {name} died (exit code {rc}) after {sup.max_restarts} restarts: giving up")
            if role in ("learner", "dispatcher"):
                if not sup.restore_on_crash:
                    raise RunError(f"{name} died (exit code {rc}) and supervision.restore_on_crash is off")
                self.backoff.next(name)
                self._restore_run(f"{name} died (exit code {rc})")
                return
            delay = self.backoff.next(name)
            log.warning("%s died (exit code %d): restarting it in %.1f s", name, rc, delay)
            self.restart_due[name] = time.monotonic() + delay
            self.generator_versions.pop(name, None)
            if role == "generator":
                self._command(
                    "dispatcher", "requeue", scope="generator", generator=name, ack=f"requeue@{name}@{time.monotonic()}"
                )
            elif role == "reward":
                self._command("dispatcher", "requeue", scope="in_flight", ack=f"requeue@{name}@{time.monotonic()}")
            elif role == "buffer":
                self._command("dispatcher", "requeue", scope="buffered", ack=f"requeue@{name}@{time.monotonic()}")
        now = time.monotonic()
        for name, due in list(self.restart_due.items()):
            if now >= due:
                del self.restart_due[name]
                self.fleet.restart(name, {"ASYNCRL_RESUME": ""})  # stateless, or the buffer started empty

    def _restore_run(self, why: str) -> None:
        """Stop every process and start them all again from the last checkpoint."""
        log.error("%s: restoring the whole run from its last checkpoint", why)
        self.fleet.terminate()
        self.restores += 1
        self.finals.clear()
        self.generator_versions.clear()
        self.learner_done = None
        self.restart_due.clear()
        self.unacked.clear()
        if self.checkpoint is not None:
            self._drop_checkpoint()
        self._start_all(self._restore_point())

    # -- evaluation -----------------------------------------------------------------------------

    def _evaluate_now(self, label: str, version: int) -> dict:
        """Run an evaluation round to its end (each request bounded by its timeout, so the wait
        is too) and return its record; a periodic round still running is let finish first."""
        start = time.monotonic()
        while self.heldout.current is not None:
            self._next_event(None, f"eval {self.heldout.current.label} to finish before eval {label}")
        self.heldout.start(label, version)
        done = len(self.evals)
        while len(self.evals) == done:
            self._next_event(None, f"the generators' answers to eval {label}", wait=0.2)
        self.blocking_eval_s += time.monotonic() - start
        return self.evals[-1]

    def _on_eval(self, record: dict | None) -> None:
        if record is None:
            return
        self.evals.append(record)
        with open(self.run_dir / "evals.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.progress.eval(record)
        if record["exact_match"] is not None:
            log.info(
                "held-out exact match %s (version %d, served %s): %.3f over %d prompts in %.1f s",
                record["label"],
                record["version"],
                record["versions"],
                record["exact_match"],
                record["num_prompts"],
                record["wall_s"],
            )

    def _num_generators(self) -> int:
        return self.cfg.run.num_generators + sum(1 for role in self.joined.values() if role == "generator")

    def _next_event(self, deadline: float | None, waiting_for: str, wait: float = 0.5) -> dict | None:
        if deadline is not None and time.monotonic() > deadline:
            raise RunError(f"timed out waiting for {waiting_for}")
        self._supervise()
        self._resend()
        if self.heldout is not None:
            self._on_eval(self.heldout.poll(self._num_generators()))
        if isinstance(self.fleet, ProcessFleet):  # local children: their /proc is ours to read
            self.memory.sample({name: self.fleet.pid(name) for name in self.fleet.procs})
        msg = self.events.recv(timeout=wait)
        if msg is None:
            return None
        if msg[0] == "eval_result":
            if self.heldout is not None:
                self._on_eval(self.heldout.answer(msg[1]))
            return None
        ev = msg[1]
        self.last_event[ev["source"]] = ev
        self.last_event_at[ev["source"]] = time.monotonic()
        if ev["source"] not in self.fleet.procs and ev.get("role") in JOINABLE:
            self.joined.setdefault(ev["source"], ev["role"])
        self._handle(ev)
        return ev

    def _resource_figures(self) -> dict:
        """Memory and time figures of ``summary.json``: each process's peak RSS (its final report;
        the controller's own read here), the run's sampled total, learner step times, and the
        publication-to-served time of every version (``asyncrl.weights.timeline``)."""
        peaks = {name: f.get("peak_rss_bytes") for name, f in sorted(self.finals.items())}
        peaks["controller"] = peak_rss_bytes()  # itself alone: its descendants are the processes above
        return {
            "peak_rss_bytes": peaks,
            **self.memory.summary(),
            "learner_step_s": describe(self.step_seconds),
            "publication_to_served": self.timeline.summary(),
        }

    def _handle(self, ev: dict) -> None:
        kind = ev["type"]
        if kind == "checkpoint_part":
            self._on_checkpoint_part(ev)
        elif kind == "requeued":
            self.unacked.pop(ev.get("id"), None)
        elif kind == "final":
            self.finals[ev["source"]] = ev
        elif kind == "done" and ev["role"] == "learner":
            self.learner_done = ev
            self.done_at = time.monotonic()
        elif kind == "error":
            if not (self.training and self.cfg.supervision.restart):
                raise RunError(f"{ev['source']} failed: {ev['error']}")
            log.error("%s failed: %s", ev["source"], ev["error"])  # its exit is the supervisor's to act on
        elif kind == "broadcast":
            self._observe_served(self.timeline.on_broadcast(ev))
        elif kind == "version":
            self.generator_versions[ev["source"]] = ev["version"]
            self._observe_served(self.timeline.on_served(ev))
            log.info(
                "%s now serves policy version %d (applied in %.0f ms)",
                ev["source"],
                ev["version"],
                1000 * ev["apply_s"],
            )
        elif kind == "step":
            ev["t"] = time.monotonic() - self.go_at  # seconds since go: the x axis of throughput plots
            self.steps_seen += 1
            if ev.get("step_s") is not None:
                self.step_seconds.append(float(ev["step_s"]))
            every = self.cfg.eval.every_versions
            if self.heldout is not None and every and ev["version"] % every == 0:
                if ev["version"] < self.cfg.learner.total_steps:  # the last one is eval_after's
                    self.heldout.start(f"v{ev['version']}", ev["version"])
            with open(self.run_dir / "steps.jsonl", "a") as f:  # one line per step, for plots and tools
                f.write(json.dumps(ev) + "\n")
        if kind == "ready" and ev["role"] == "generator":
            self.generator_versions[ev["source"]] = ev.get("version", 0)
        self.progress.update(ev)

    @staticmethod
    def _observe_served(records: list[dict]) -> None:
        for record in records:
            WEIGHT_SERVED_SECONDS.labels("total").observe(record["total_s"])
            for stage, seconds in record.items():
                if stage != "total_s":
                    WEIGHT_SERVED_SECONDS.labels(stage.removesuffix("_s")).observe(seconds)

    def _log_waits(self, stalled_s: float) -> None:
        log.warning(
            "no learner step for %.0f s (the run stops at %.0f s: %s); each process's last word:",
            stalled_s,
            self.watch.bound(),
            self._bound_rule(),
        )
        now, dead = time.monotonic(), self.fleet.dead()
        for name in sorted(self.fleet.procs):
            ev = self.last_event.get(name)
            alive = name not in dead
            said = f"{ev['type']} {now - self.last_event_at[name]:.0f} s ago" if ev else "nothing yet"
            log.warning("  %s (%s): %s%s", name, "alive" if alive else "exited", said, _waits_for(ev))

    def _dump_state(self) -> None:
        log.error("run aborted; last event of each process:")
        for name in sorted(self.fleet.procs):
            log.error("  %s: %s", name, self.last_event.get(name, "(nothing received)"))
