"""The controller: prepares the model, starts every component as a local process, watches them,
stops them in dataflow order so nothing is lost, and writes ``summary.json``.

Start: every process reports ready, then the controller says go and the dispatcher starts handing
out prompts. Stop order: when the learner has taken its last step, the dispatcher stops, every
generator finishes the batch it is sampling and loads the final weights (so each reports serving
the final version), the generators stop, then the reward workers drain their
input, then the buffer takes the rest and reconciles, then the learner exits. Each stage reports
its final counters, from which ``accounting.summarize`` checks that every sample is accounted for.

Nothing waits forever: start-up, steps and shutdown each have a timeout; when one passes, the
controller logs what every process last said and aborts the run (stopping only its own children).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import yaml

from asyncrl import security
from asyncrl.accounting import summarize
from asyncrl.config import RunConfig, dump_config
from asyncrl.endpoints import Endpoints, free_ports
from asyncrl.fleet import ProcessFleet
from asyncrl.progress import RunProgress
from asyncrl.transport import Publisher, StreamReceiver

log = logging.getLogger("asyncrl")


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
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        DS_ACCELERATOR="cpu" if not _has_cuda() else env.get("DS_ACCELERATOR", "cuda"),
        TMPDIR=str(tmp),
        PYTHONUNBUFFERED="1",
    )
    return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def prepare_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.run.root) / cfg.run.name
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise RunError(f"run directory {run_dir} exists and run.overwrite is false")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir.resolve()


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The policy RL starts from: a given model, or the tiny model built here, warm-started by SFT."""
    from asyncrl.sft import run_sft
    from asyncrl.tasks import load_prompts
    from asyncrl.tinymodel import build_tiny_model

    if cfg.model.path is not None:
        base = Path(cfg.model.path)
    else:
        base = build_tiny_model(cfg.model.tiny.model_copy(update={"seed": cfg.run.seed}), run_dir / "model" / "base")
        log.info("built the tiny model in %s", base)
    if not cfg.model.warm_start:
        return base
    warm = run_dir / "model" / "warm"
    stats = run_sft(base, load_prompts(cfg.task, "train"), cfg.sft, warm)
    log.info("SFT warm start: %d steps, final loss %.3f, %.1f s", stats["steps"], stats["final_loss"], stats["seconds"])
    return warm


def evaluate(cfg: RunConfig, model_dir: Path) -> float:
    from asyncrl.evaluation import evaluate_exact_match
    from asyncrl.tasks import load_prompts

    prompts = load_prompts(cfg.task, "test")[: cfg.eval.num_prompts]
    return evaluate_exact_match(model_dir, None, prompts, max_new_tokens=cfg.eval.max_new_tokens)


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


class Controller:
    """Runs one training job on this machine."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = prepare_run_dir(cfg)
        self.finals: dict[str, dict] = {}
        self.last_event: dict[str, dict] = {}
        self.generator_versions: dict[str, int] = {}
        self.step_events: list[dict] = []
        self.progress = RunProgress(cfg, self.run_dir)  # console and step loggers
        self.learner_done: dict | None = None
        self.go_at = self.done_at = 0.0  # monotonic times of "go" and of the learner's last step

    def run(self) -> dict:
        cfg = self.cfg
        t0 = time.monotonic()
        simulated = cfg.simulation.learner is not None
        model_dir = Path("none") if simulated else prepare_model(cfg, self.run_dir)
        eval_before = None if simulated else evaluate(cfg, model_dir)
        if eval_before is not None:
            log.info("held-out exact match before RL: %.3f", eval_before)
        security.configure(cfg.security)  # before the first socket: CURVE and size limits
        endpoints = Endpoints.allocate()
        endpoints.save(self.run_dir)
        self.events = StreamReceiver(endpoints.events, name="controller.events", hwm=10_000)
        self.control = Publisher(endpoints.control, name="controller.control")
        self.fleet = ProcessFleet(self.run_dir, model_dir, child_env(self.run_dir))
        self.progress.watch(self.fleet, eval_before)
        rl_start = time.monotonic()
        cpu_start = time.process_time()
        try:
            self._start_all()
            self._train()
            self._stop_in_order()
        except BaseException:
            self.progress.close()
            self._dump_state()
            raise
        finally:
            self.fleet.terminate()
            self.events.close()
            self.control.close()
        rl_wall = time.monotonic() - rl_start
        controller_cpu_s = time.process_time() - cpu_start
        eval_after = None if simulated else evaluate(cfg, self.run_dir / "final")
        if eval_after is not None:
            log.info("held-out exact match after RL: %.3f (before %.3f)", eval_after, eval_before)
        summary = summarize(self.finals, rl_wall, eval_before, eval_after)
        summary["controller_cpu_s"] = controller_cpu_s
        summary["train_wall_s"] = self.done_at - self.go_at  # steady state: from go to the last step
        summary["total_wall_s"] = time.monotonic() - t0
        summary["generator_versions"] = self.generator_versions
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.progress.close(summary)
        return summary

    # -- phases ---------------------------------------------------------------------------------

    def _start_all(self) -> None:
        cfg, fleet = self.cfg, self.fleet
        fleet.start("buffer", "buffer")
        fleet.start("reward", "reward-0")
        fleet.start("dispatcher", "dispatcher")
        if cfg.algorithm.kl.enabled and cfg.algorithm.kl.reference == "process":
            fleet.start("reference", "reference")
        fleet.start(
            "learner",
            "learner",
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_ports(1)[0]),
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
            },
        )
        for i in range(cfg.run.num_generators):
            fleet.start("generator", f"generator-{i}")
        ready = set()
        deadline = time.monotonic() + cfg.run.startup_timeout_s
        while len(ready) < len(fleet.procs):
            ev = self._next_event(deadline, "every process to report ready")
            if ev and ev["type"] == "ready":
                ready.add(ev["source"])
        log.info("all %d processes ready: %s", len(ready), ", ".join(sorted(ready)))
        write_scrape_config(self.run_dir)
        for _ in range(10):  # PUB: repeat, so that no subscriber misses it
            self.control.send("control", {"command": "go"})
            time.sleep(0.01)
        self.go_at = time.monotonic()

    def _train(self) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.run.stall_timeout_s
        while self.learner_done is None:
            ev = self._next_event(deadline, "the learner's next step")
            if ev and ev["type"] == "step":
                deadline = time.monotonic() + cfg.run.stall_timeout_s

    def _stop_in_order(self) -> None:
        self._stop(["dispatcher"])
        self._await_final_weights()
        for roles in (["generator"], ["reward"], ["buffer"], ["learner"], ["reference"]):
            self._stop(roles)

    def _stop(self, roles: list[str], timeout: float = 120) -> None:
        names = [n for r in roles for n in self.fleet.names(r)]
        deadline = time.monotonic() + timeout
        while not (all(n in self.finals for n in names) and self.fleet.exited(names)):
            self.control.send("control", {"command": "stop", "roles": roles})
            self._next_event(deadline, f"{', '.join(roles)} to stop", wait=0.2)

    def _await_final_weights(self, timeout: float = 60) -> None:
        """With no more prompts, every generator picks up the last published version."""
        final = self.learner_done["version"]
        deadline = time.monotonic() + timeout
        names = self.fleet.names("generator")
        while any(self.generator_versions.get(n, -1) < final for n in names):
            if time.monotonic() > deadline:
                log.warning(
                    "generators still serve %s, not version %d, after %.0f s", self.generator_versions, final, timeout
                )
                return
            self._next_event(deadline + 1, "generators to load the final weights", wait=0.2)

    # -- events ---------------------------------------------------------------------------------

    def _next_event(self, deadline: float, waiting_for: str, wait: float = 0.5) -> dict | None:
        if time.monotonic() > deadline:
            raise RunError(f"timed out waiting for {waiting_for}")
        dead = {n: rc for n, rc in self.fleet.dead().items() if n not in self.finals}
        if dead:
            raise RunError(f"process(es) died: {dead}; see {self.run_dir / 'logs'}")
        msg = self.events.recv(timeout=wait)
        if msg is None:
            return None
        ev = msg[1]
        self.last_event[ev["source"]] = ev
        self._handle(ev)
        return ev

    def _handle(self, ev: dict) -> None:
        kind = ev["type"]
        if kind == "final":
            self.finals[ev["source"]] = ev
        elif kind == "done" and ev["role"] == "learner":
            self.learner_done = ev
            self.done_at = time.monotonic()
        elif kind == "error":
            raise RunError(f"{ev['source']} failed: {ev['error']}")
        elif kind == "version":
            self.generator_versions[ev["source"]] = ev["version"]
            log.info(
                "%s now serves policy version %d (applied in %.0f ms)",
                ev["source"],
                ev["version"],
                1000 * ev["apply_s"],
            )
        elif kind == "step":
            ev["t"] = time.monotonic() - self.go_at  # seconds since go: the x axis of throughput plots
            self.step_events.append(ev)
            with open(self.run_dir / "steps.jsonl", "a") as f:  # one line per step, for plots and tools
                f.write(json.dumps(ev) + "\n")
        if kind == "ready" and ev["role"] == "generator":
            self.generator_versions[ev["source"]] = ev.get("version", 0)
        self.progress.update(ev)

    def _dump_state(self) -> None:
        log.error("run aborted; last event of each process:")
        for name in sorted(self.fleet.procs):
            log.error("  %s: %s", name, self.last_event.get(name, "(nothing received)"))
