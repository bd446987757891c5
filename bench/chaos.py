"""Chaos: kill components of a running pipeline with SIGKILL, then reconcile every sample by id.

    OMP_NUM_THREADS=1 .venv/bin/python bench/chaos.py [--kills 12] [--seed 0] [--simulated] [--config C] [--out F]

Runs a training job (``configs/demo.yaml``'s toy pipeline: real vLLM generators and DeepSpeed
learner; ``--simulated``: the simulated engines of ``configs/bench_pipeline.yaml``; ``--config``:
another recipe, e.g. ``configs/guess_number.yaml``'s multi-turn episodes) under the
controller's supervision, with checkpoints every few steps. A killer thread, seeded, waits a
random few seconds, SIGKILLs one of a generator, the reward worker, the buffer or the learner
(and, with ``learner.ranks`` above 1, learner rank 1: ``learner-1``, which takes the whole group
back to the checkpoint; with ``agent.command``, an agent program playing an episode through a
generator's gateway, whose episode ends unscored), waits until the run has recovered (the process is back and the learner has stepped again), and
repeats until ``--kills`` kills are done. Then it lets the run finish and replays the group
ledger: every uid that was dispatched must be trained once, dropped with a named reason, or held
at the end.

Prints JSON: ``generated`` (uids dispatched), ``trained``, ``trained_twice``, ``dropped`` by
reason, ``held``, ``lost`` (no outcome), ``hangs`` (the run stalled past its timeout), the kills
with their times, restarts and restores. Expected: lost = trained_twice = hangs = 0.

And no orphans (``asyncrl.fleet.process_tree``): each kill records the killed component's process
tree (its PID and every descendant, e.g. vLLM's engine core) and how many of them still live
``ORPHAN_WAIT_S`` later (``survivors``); ``survivors_after_kill`` sums them. At the end,
``survivors_at_end`` lists every process the run started that still lives: the descendants of
this process, every process seen in a component's tree (sampled each second, matched by PID and
start time, so a PID reused by someone else is not counted), and every member of a component's
process group; ``orphans_at_end`` those of them re-parented to init. Expected: both empty, and
the benchmark fails (exit 1) otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.fleet import process_tree  # noqa: E402 (after the path above)

TARGETS = ("generator", "reward", "buffer", "learner")
"""Roles whose processes are killed in turn (any of the role's processes)."""


def targets(cfg) -> tuple[str, ...]:
    """The kill rotation: every role of ``TARGETS``, learner rank 1 by name when the learner
    has several ranks (``learner`` alone is rank 0), and, with an agent program
    (``agent.command``), one of the programs playing an episode against a generator's gateway."""
    return TARGETS + (("learner-1",) if cfg.learner.ranks > 1 else ()) + (("agent",) if cfg.agent.command else ())


def agent_programs(fleet, processes: SeenProcesses, command: list[str]) -> list[int]:
    """PIDs of the agent programs running now: the generators' descendants whose command line
    is ``command``'s."""
    wanted = " ".join(command)[:160]
    pids = []
    for name in fleet.names("generator"):
        for pid in processes.tree(fleet.pid(name))[1:]:
            if (d := describe(pid)) is not None and d["cmd"].startswith(wanted):
                pids.append(pid)
    return pids


ORPHAN_WAIT_S = 10.0
"""Seconds a killed component's tree is given to be gone (its children's watch looks every 0.5 s)."""


def start_time(pid: int) -> int | None:
    """``pid``'s start time (clock ticks after boot, /proc/PID/stat field 22): with the PID, who it is."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(text[text.rindex(")") + 2 :].split()[19])


def describe(pid: int) -> dict | None:
    """PID, parent PID and command line of a live process (None once it is gone)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None
    return {"pid": pid, "ppid": ppid, "cmd": cmd[:160]}


class SeenProcesses:
    """Every process the run's components are seen to start: component PIDs (hence their process
    groups) and their descendants, each with its start time."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}  # pid -> start time
        self.groups: set[int] = set()  # component PIDs: the groups they lead
        self.lock = threading.Lock()

    def tree(self, pid: int) -> list[int]:
        """``pid`` and its live descendants, recorded as seen."""
        pids = [pid, *process_tree.descendants(pid)]
        with self.lock:
            self.groups.add(pid)
            for p in pids:
                if (t := start_time(p)) is not None:
                    self.seen.setdefault(p, t)
        return pids

    def sample(self, fleet) -> None:
        for name in list(fleet.procs):
            self.tree(fleet.pid(name))

    def survivors(self) -> list[dict]:
        """Every process of the run that still lives (this process's own threads' helpers aside)."""
        with self.lock:
            pids = {p for p, t in self.seen.items() if start_time(p) == t}
            for pgid in self.groups:
                pids.update(process_tree.group_members(pgid))
        pids.update(process_tree.descendants(os.getpid()))
        return [d for p in sorted(pids) if p != os.getpid() and (d := describe(p)) is not None]


def sampler(controller, processes: SeenProcesses, stop: threading.Event) -> None:
    """Record the components' trees every second (local processes only: a Ray fleet's are remote)."""
    from asyncrl.fleet.local import ProcessFleet

    while not stop.wait(1.0):
        fleet = getattr(controller, "fleet", None)
        if isinstance(fleet, ProcessFleet):
            processes.sample(fleet)


def killer(
    controller,
    kills: int,
    seed: int,
    gap_s: tuple[float, float],
    log: list,
    stop: threading.Event,
    processes: SeenProcesses,
) -> None:
    """Kill ``kills`` components at seeded random moments, each after the run recovered; record
    which processes of the killed component's tree outlived it."""
    rng = random.Random(seed)
    rotation = targets(controller.cfg)
    while len(log) < kills and not stop.is_set():
        if stop.wait(rng.uniform(*gap_s)):
            return
        fleet = getattr(controller, "fleet", None)
        if fleet is None or not controller.supervisor.training or controller.progress.learner_done is not None:
            continue
        target = rotation[len(log) % len(rotation)] if len(log) < len(rotation) else rng.choice(rotation)
        if target == "agent":  # a client of the gateway: its episode ends unscored, the run goes on
            programs = agent_programs(fleet, processes, controller.cfg.agent.command)
            if programs:
                pid = rng.choice(programs)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    log.append(
                        {"name": "agent", "t": round(time.monotonic() - controller.progress.go_at, 2), "tree": 1}
                        | {"step": controller.progress.steps_seen, "survivors": []}
                    )
            continue
        dead = fleet.dead()
        candidates = [target] if target in fleet.procs else fleet.names(target)  # a process, or a role
        if target == "learner":
            candidates = ["learner"]  # rank 0; rank 1 is its own target
        names = [n for n in candidates if n not in dead and n not in controller.supervisor.restart_due]
        if not names:
            continue
        name = rng.choice(names)
        steps_before = controller.progress.steps_seen
        pid = fleet.pid(name)
        tree = processes.tree(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        entry = {"name": name, "t": round(time.monotonic() - controller.progress.go_at, 2), "step": steps_before}
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while process_tree.alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        entry.update(tree=len(tree), survivors=[d for p in process_tree.alive(tree) if (d := describe(p))])
        log.append(entry)
        # Recovered: the learner stepped again after the kill and nothing waits for a restart.
        deadline = time.monotonic() + 600
        while not stop.is_set() and time.monotonic() < deadline:
            if controller.progress.steps_seen > steps_before + 1 and not controller.supervisor.restart_due:
                break
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=12, help="SIGKILLs to deliver (at least 10 for the evidence)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--simulated", action="store_true", help="simulated engines instead of vLLM + DeepSpeed")
    parser.add_argument(
        "--config", help="the recipe to run (default configs/demo.yaml, or bench_pipeline.yaml with --simulated)"
    )
    parser.add_argument("--steps", type=int, help="learner steps (default: enough for the kills)")
    parser.add_argument("--gap", type=float, nargs=2, default=(2.0, 6.0), help="seconds between recovery and kill")
    parser.add_argument("--root", default="runs", help="folder of the run directory")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import logging

    from asyncrl.config import load_config
    from asyncrl.controller.errors import RunError
    from asyncrl.controller.process import Controller

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    recipe = ROOT / (args.config or ("configs/bench_pipeline.yaml" if args.simulated else "configs/demo.yaml"))
    steps = args.steps or (400 if args.simulated else 200)
    overrides = [
        f"run.root={args.root}",
        "run.name=chaos",
        f"learner.total_steps={steps}",
        "checkpoint.every_steps=10",
        "checkpoint.keep_last=2",
        "supervision.backoff_initial_s=0.5",
        "supervision.backoff_max_s=4",
        "supervision.max_restarts=20",
        "run.stall_timeout_s=300",
        *args.overrides,
    ]
    if args.simulated:
        overrides += ["sampling.max_tokens=128", "run.num_generators=2"]
    cfg = load_config(recipe, overrides)
    controller = Controller(cfg)
    kills: list[dict] = []
    stop = threading.Event()
    processes = SeenProcesses()
    thread = threading.Thread(
        target=killer, args=(controller, args.kills, args.seed, tuple(args.gap), kills, stop, processes), daemon=True
    )
    thread.start()
    watcher = threading.Thread(target=sampler, args=(controller, processes, stop), daemon=True)
    watcher.start()
    start = time.monotonic()
    hangs, error, summary = 0, None, {}
    try:
        summary = controller.run()
    except RunError as e:
        error = str(e)
        hangs = int("timed out" in error)
    finally:
        stop.set()
        thread.join(timeout=ORPHAN_WAIT_S + 5)
        watcher.join(timeout=5)
    survivors = processes.survivors()
    from asyncrl.rundir.ledger_replay import reconcile_ledger

    ledger = reconcile_ledger(controller.run_dir, cfg.sampling.n)
    result = {
        "pipeline": "simulated" if args.simulated else "toy (vLLM + DeepSpeed)",
        "recipe": str(recipe.relative_to(ROOT)),
        "seed": args.seed,
        "learner_steps": summary.get("learner_steps"),
        "generated": ledger["dispatched"],
        "trained": ledger["trained"],
        "trained_twice": ledger["trained_twice"],
        "dropped": ledger["dropped"],
        "held": ledger["held"],
        "returned_unsampled": ledger["returned_unsampled"],
        "lost": ledger["lost"],
        "lost_groups": ledger["lost_groups"],
        "hangs": hangs,
        "error": error,
        "kills": kills,
        "num_kills": len(kills),
        "survivors_after_kill": sum(len(k["survivors"]) for k in kills),
        "survivors_at_end": survivors,
        "orphans_at_end": [d for d in survivors if d["ppid"] == 1],
        "processes_seen": len(processes.seen),
        "restarts": len(controller.supervisor.deaths) - controller.supervisor.restores,
        "restores": controller.supervisor.restores,
        "checkpoints": controller.checkpoints.committed if controller.checkpoints is not None else [],
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "wall_s": round(time.monotonic() - start, 1),
        "unit": ledger["unit"],
        "generator_mode": cfg.generator.mode,
        "overrides": args.overrides,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    ok = (
        not error
        and result["lost"] == 0
        and result["trained_twice"] == 0
        and len(kills) >= min(args.kills, 10)
        and result["survivors_after_kill"] == 0
        and not survivors
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
