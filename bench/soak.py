"""Soak: the pipeline for a given number of minutes, sampling every process's resident memory.

Starts ``asyncrl train RECIPE`` (default: the simulated fleet of ``configs/bench_pipeline.yaml``,
two generators, with the learner slowed so the box is not saturated) with a step budget it
never reaches, and every ``--interval`` seconds reads the RSS of the controller and of each of
its descendants (found from the controller's PID through psutil, never by name). After
``--minutes`` it interrupts the controller (SIGINT: it stops its children by PID) and fits, per
process, a least-squares line to RSS over time after ``--warmup`` seconds:

    slope (MiB/hour) +- its standard error,   noise = residual standard deviation (MiB)

and calls a process flat when the upper end of its 95 % interval, over 30 minutes, stays within
max(2 x noise, 1 MiB). The baseline, measured in the same run, is an idle process started by
this script that imports the same modules and holds a ZeroMQ socket: its slope is what the
measurement itself shows for a process that does nothing. The run directory's group ledger is
sized at every sample too: ``ledger_bytes_per_hour`` is the same fit over its bytes (segments
rotated past ``checkpoint.ledger_segment_mb``, compacted at each checkpoint), beside the bytes
at the end, ``ledger_bytes_per_group`` (over the groups the dispatcher handed out) and the
replay of the ledger across its segments (``ledger_replay``, in groups).

Prints one JSON object (with the commit measured: ``asyncrl.benchmarks.provenance``) and writes it to ``bench/results/soak.json`` (``--out``)::

    OMP_NUM_THREADS=1 .venv/bin/python bench/soak.py --minutes 30 [--interval 5] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402

MiB = 1 << 20
LIGHT = [  # fewer processes and a slower learner: memory behaviour without saturating 2 cores
    "run.num_generators=2",
    "simulation.learner.step_overhead_s=0.25",
    "run.stall_timeout_s=600",
]
BASELINE = (
    "import time, zmq, numpy, asyncrl.wire.sockets, asyncrl.wire.schema\n"
    "s = zmq.Context.instance().socket(zmq.PULL); s.bind('tcp://127.0.0.1:*')\n"
    "while True: time.sleep(1)\n"
)


def name_of(p: psutil.Process, controller: int, baseline: int) -> str:
    """The component name from ``python -m asyncrl.fleet.child ROLE NAME ...``, else a stable label."""
    if p.pid == controller:
        return "controller"
    if p.pid == baseline:
        return "baseline-idle"
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return f"pid-{p.pid}"
    if "asyncrl.fleet.child" in cmd:
        i = cmd.index("asyncrl.fleet.child")
        return cmd[i + 2]
    return f"{Path(cmd[0]).name if cmd else 'proc'}-{p.pid}"


ROLLUP = ("Rss", "Pss", "Anonymous", "Pss_Anon", "Pss_File", "Pss_Shmem")
"""Fields of ``/proc/PID/smaps_rollup`` kept per sample: what grows, anonymous or file-backed
memory, and a process's own share of pages it shares (PSS) beside what it maps (RSS)."""


def rollup(pid: int) -> dict[str, float]:
    """``ROLLUP`` fields of a process in MiB (empty where the kernel has no smaps_rollup)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ROLLUP:
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def sample(controller: psutil.Process, baseline: psutil.Process) -> dict[str, dict[str, float]]:
    """name -> {Rss, Pss, Anonymous, ...} in MiB of the controller, its descendants and the baseline."""
    out = {}
    try:
        procs = [controller, *controller.children(recursive=True), baseline]
    except psutil.NoSuchProcess:
        procs = [baseline]
    for p in procs:
        try:
            rss = p.memory_info().rss / MiB
        except psutil.Error:
            continue  # exited between listing and reading
        out[name_of(p, controller.pid, baseline.pid)] = {**rollup(p.pid), "Rss": rss}
    return out


def fit(ts: list[float], ys: list[float]) -> dict:
    """Least-squares slope (per hour) with its standard error and the residual noise."""
    n = len(ts)
    hours = [t / 3600 for t in ts]
    mt, my = sum(hours) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in hours)
    slope = sum((t - mt) * (y - my) for t, y in zip(hours, ys)) / sxx
    resid = [y - (my + slope * (t - mt)) for t, y in zip(hours, ys)]
    noise = math.sqrt(sum(r * r for r in resid) / max(n - 2, 1))
    stderr = noise / math.sqrt(sxx)
    upper_30min = 0.5 * (abs(slope) + 1.96 * stderr)
    return {
        "slope_mib_per_h": round(slope, 3),
        "slope_stderr_mib_per_h": round(stderr, 3),
        "noise_mib": round(noise, 3),
        "rss_first_mib": round(ys[0], 1),
        "rss_last_mib": round(ys[-1], 1),
        "rss_max_mib": round(max(ys), 1),
        "samples": n,
        "flat": upper_30min <= max(2 * noise, 1.0),
    }


def describe(points: list[tuple[float, dict[str, float]]], warmup: float) -> dict | None:
    """The flatness test on RSS after ``warmup`` (``fit``), the shape behind it (mean RSS per
    quarter of the window, slopes of its first and second half) and what moves: slopes of each
    ``ROLLUP`` field (anonymous or file-backed, RSS or PSS). None with fewer than 3 samples."""
    kept = [(t, m) for t, m in points if t >= warmup]
    if len(kept) < 3:
        return None
    ts = [t for t, _ in kept]
    out = fit(ts, [m["Rss"] for _, m in kept])
    # The shape behind the slope: a line that keeps rising, or steps that level off.
    quarters = [kept[i * len(kept) // 4 : (i + 1) * len(kept) // 4] for i in range(4)]
    out["rss_quarter_means_mib"] = [round(sum(m["Rss"] for _, m in q) / len(q), 2) for q in quarters if q]
    half = len(kept) // 2
    if half >= 3:
        out["rss_slope_halves_mib_per_h"] = [
            fit([t for t, _ in part], [m["Rss"] for _, m in part])["slope_mib_per_h"]
            for part in (kept[:half], kept[half:])
        ]
    out["slopes_mib_per_h"] = {
        key: fit(ts, [m[key] for _, m in kept])["slope_mib_per_h"] for key in ROLLUP if all(key in m for _, m in kept)
    }
    out["last_mib"] = {key: round(v, 1) for key, v in kept[-1][1].items()}
    return out


def stop(proc: subprocess.Popen, known: set[int], timeout: float = 60) -> None:
    """SIGINT the controller (it stops its children by PID), then end any straggler we saw, by PID."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in known:
        try:
            p = psutil.Process(pid)
            p.terminate()
            p.wait(10)
        except psutil.TimeoutExpired:
            p.kill()
        except psutil.Error:
            pass


def ledger_bytes(run_dir: Path) -> int:
    """Bytes of the run's group ledger on disk (its segments and compacted state)."""
    folder = run_dir / "ledger"
    try:
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    except FileNotFoundError:  # not yet created, or a segment renamed while listed
        return ledger_bytes(run_dir) if folder.exists() else 0


def replayed_ledger(run_dir: Path) -> dict:
    """The run's ledger replayed across its segments and compacted state (groups, not samples)."""
    from asyncrl.rundir.ledger_replay import reconcile_ledger

    return reconcile_ledger(run_dir)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of start-up left out of the fit")
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "bench_pipeline.yaml"))
    ap.add_argument("--full", action="store_true", help="the recipe as is, without the lighter fleet")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the run (its components inherit it), e.g. MALLOC_ARENA_MAX=4; repeatable",
    )
    ap.add_argument(
        "--note",
        default="machine shared with other jobs",
        help="written into the JSON as is: what else ran on the machine",
    )
    ap.add_argument("overrides", nargs="*", help="dotted overrides of the recipe")
    args = ap.parse_args(argv)
    if args.minutes * 60 <= args.warmup + 3 * args.interval:
        raise SystemExit(f"--minutes ({args.minutes}) must leave at least 3 samples after --warmup ({args.warmup} s)")

    root = Path(tempfile.mkdtemp(prefix="asyncrl-soak-"))
    overrides = [*([] if args.full else LIGHT), *args.overrides]
    overrides += ["learner.total_steps=1000000000", "run.name=soak", f"run.root={root}"]
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    load_at_start = os.getloadavg()
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", args.recipe, *overrides]
    log = open(root / "controller.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    idle = subprocess.Popen([sys.executable, "-c", BASELINE], env=env, cwd=ROOT)
    controller, baseline = psutil.Process(proc.pid), psutil.Process(idle.pid)
    series: dict[str, list[tuple[float, dict[str, float]]]] = {}
    ledger: list[tuple[float, int]] = []  # (seconds, bytes of RUN_DIR/ledger)
    known: set[int] = set()
    start = time.monotonic()
    try:
        while (t := time.monotonic() - start) < args.minutes * 60:
            if proc.poll() is not None:
                raise SystemExit(f"the run ended early (exit {proc.returncode}); see {root / 'controller.log'}")
            try:
                known.update(c.pid for c in controller.children(recursive=True))
            except psutil.Error:
                pass
            for name, mem in sample(controller, baseline).items():
                series.setdefault(name, []).append((t, mem))
            ledger.append((t, ledger_bytes(root / "soak")))
            time.sleep(max(0.0, args.interval - (time.monotonic() - start - t)))
    finally:
        stop(proc, known)
        idle.terminate()
        idle.wait()
    steps = sum(1 for _ in open(root / "soak" / "steps.jsonl")) if (root / "soak" / "steps.jsonl").exists() else None
    per_process = {name: describe(points, args.warmup) for name, points in sorted(series.items())}
    per_process = {name: d for name, d in per_process.items() if d is not None}
    with open(root / "rss.jsonl", "w") as f:  # every sample, for plots
        for name, points in sorted(series.items()):
            row = {"process": name, "t_s": [round(t, 1) for t, _ in points]}
            for key in ("Rss", *ROLLUP[1:]):
                row[f"{key.lower()}_mib"] = [round(m.get(key, math.nan), 2) for _, m in points]
            f.write(json.dumps(row) + "\n")
    base = per_process.get("baseline-idle", {})
    kept = [(t, b) for t, b in ledger if t >= args.warmup]
    replay = replayed_ledger(root / "soak")
    groups = replay["dispatched"]
    result = {
        "commit": measured_commit(),
        "minutes": args.minutes,
        "interval_s": args.interval,
        "warmup_s": args.warmup,
        "recipe": os.path.relpath(args.recipe, ROOT),
        "overrides": overrides[:-2],
        "env": extra_env,
        "note": args.note,
        "load_average_at_start": [round(x, 2) for x in load_at_start],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "learner_steps": steps,
        "baseline_slope_mib_per_h": base.get("slope_mib_per_h"),
        "all_flat": all(v["flat"] for v in per_process.values()),
        "processes": per_process,
        "ledger_bytes_per_hour": round(fit([t for t, _ in kept], [b / MiB for _, b in kept])["slope_mib_per_h"] * MiB)
        if len(kept) >= 3
        else None,
        "ledger_bytes_at_end": ledger[-1][1] if ledger else None,
        "ledger_bytes_per_group": round(ledger[-1][1] / groups, 2) if ledger and groups else None,
        "ledger_replay": {k: replay[k] for k in ("dispatched", "trained", "trained_twice", "lost", "held")},
        "run_dir": str(root / "soak"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
