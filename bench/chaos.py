"""Chaos: kill components of a running pipeline with SIGKILL, then reconcile every sample by id.

    OMP_NUM_THREADS=1 .venv/bin/python bench/chaos.py [--kills 12] [--seed 0] [--simulated] [--out F]

Runs a training job (``configs/demo.yaml``'s toy pipeline: real vLLM generators and DeepSpeed
learner; ``--simulated``: the simulated engines of ``configs/bench_pipeline.yaml``) under the
controller's supervision, with checkpoints every few steps. A killer thread, seeded, waits a
random few seconds, SIGKILLs one of a generator, the reward worker, the buffer or the learner
(and, with ``learner.ranks`` above 1, learner rank 1: ``learner-1``, which takes the whole group
back to the checkpoint), waits until the run has recovered (the process is back and the learner has stepped again), and
repeats until ``--kills`` kills are done. Then it lets the run finish and replays the group
ledger: every uid that was dispatched must be trained once, dropped with a named reason, or held
at the end.

Prints JSON: ``generated`` (uids dispatched), ``trained``, ``trained_twice``, ``dropped`` by
reason, ``held``, ``lost`` (no outcome), ``hangs`` (the run stalled past its timeout), the kills
with their times, restarts and restores. Expected: lost = trained_twice = hangs = 0.
"""

from __future__ import annotations

import argparse
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

TARGETS = ("generator", "reward", "buffer", "learner")
"""Roles whose processes are killed in turn (any of the role's processes)."""


def targets(cfg) -> tuple[str, ...]:
    """The kill rotation: every role of ``TARGETS``, and learner rank 1 by name when the learner
    has several ranks (``learner`` alone is rank 0)."""
    return TARGETS + (("learner-1",) if cfg.learner.ranks > 1 else ())


def killer(controller, kills: int, seed: int, gap_s: tuple[float, float], log: list, stop: threading.Event) -> None:
    """Kill ``kills`` components at seeded random moments, each after the run recovered."""
    rng = random.Random(seed)
    rotation = targets(controller.cfg)
    while len(log) < kills and not stop.is_set():
        if stop.wait(rng.uniform(*gap_s)):
            return
        fleet = getattr(controller, "fleet", None)
        if fleet is None or not controller.supervisor.training or controller.progress.learner_done is not None:
            continue
        target = rotation[len(log) % len(rotation)] if len(log) < len(rotation) else rng.choice(rotation)
        dead = fleet.dead()
        candidates = [target] if target in fleet.procs else fleet.names(target)  # a process, or a role
        if target == "learner":
            candidates = ["learner"]  # rank 0; rank 1 is its own target
        names = [n for n in candidates if n not in dead and n not in controller.supervisor.restart_due]
        if not names:
            continue
        name = rng.choice(names)
        steps_before = controller.progress.steps_seen
        try:
            os.kill(fleet.pid(name), signal.SIGKILL)
        except ProcessLookupError:
            continue
        log.append({"name": name, "t": round(time.monotonic() - controller.progress.go_at, 2), "step": steps_before})
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
    recipe = ROOT / ("configs/bench_pipeline.yaml" if args.simulated else "configs/demo.yaml")
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
    thread = threading.Thread(
        target=killer, args=(controller, args.kills, args.seed, tuple(args.gap), kills, stop), daemon=True
    )
    thread.start()
    start = time.monotonic()
    hangs, error, summary = 0, None, {}
    try:
        summary = controller.run()
    except RunError as e:
        error = str(e)
        hangs = int("timed out" in error)
    finally:
        stop.set()
        thread.join(timeout=5)
    from asyncrl.rundir.ledger_replay import reconcile_ledger

    ledger = reconcile_ledger(controller.run_dir, cfg.sampling.n)
    result = {
        "pipeline": "simulated" if args.simulated else "toy (vLLM + DeepSpeed)",
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
    ok = not error and result["lost"] == 0 and result["trained_twice"] == 0 and len(kills) >= min(args.kills, 10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
