"""The rehearsal at a real size: ``configs/rehearsal_0_5b.yaml`` through the real pipeline, with
this machine's free memory and every process's memory sampled from /proc each second.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rehearsal.py --out runs/rehearsal      # -> bench/results/rehearsal.json
    .venv/bin/python bench/rehearsal.py --out runs/r2 --result none learner.total_steps=2

The run is ``asyncrl train`` in a child process (the recipe plus any dotted overrides). What the
run reports itself is copied from its ``summary.json``: reconciliation, versions served, each
process's peak RSS (``peak_rss_bytes``), the learner's step times (``learner_step_s``; each step's
``step_s`` from ``steps.jsonl`` too), the seconds from each version's publication to each
generator serving it (``publication_to_served``) and the lowest ``MemAvailable`` the controller
saw while training. A thread here watches the whole run, model build and evaluations included,
once a second: ``MemAvailable`` (``min_available_gib``: the figure to hold against the machine,
which must keep >= 3 GiB of its 24 GiB free) and, for the controller and every process below it,
VmRSS and PSS (/proc/PID/smaps_rollup: shared pages, such as the weights in /dev/shm that the
learner and the generator both map, divided among their users; RSS counts them in each).

One JSON object on stdout; ``summary`` holds the run's whole summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.observability.procmem import descendants, mem_available_bytes  # noqa: E402

GiB = 1 << 30


def process_name(pid: int) -> str:
    """The component a process runs (``asyncrl.fleet.child ROLE NAME ...`` gives NAME), else its command."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    args = [a.decode(errors="replace") for a in argv if a]
    if "asyncrl.fleet.child" in args:
        return args[args.index("asyncrl.fleet.child") + 2]
    if "asyncrl.cli" in args:
        return "controller"
    return f"{Path(args[0]).name if args else '?'}-{pid}"


def process_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in bytes."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            pss = int(line.split()[1]) * 1024
    return rss, pss


class MemorySampler:
    """Samples MemAvailable and the memory of ``root``'s process tree every ``interval_s`` in a thread.

    Keeps the minimum MemAvailable, each process's peak RSS and PSS (by component name), and the
    peak of the tree's summed PSS. ``stop()`` ends the thread and returns the figures in GiB.
    """

    def __init__(self, root: int, interval_s: float = 1.0):
        self.root, self.interval_s = root, interval_s
        self.min_available = mem_available_bytes()
        self.peak_rss: dict[str, int] = {}
        self.peak_pss: dict[str, int] = {}
        self.peak_tree_pss = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        self.min_available = min(self.min_available, mem_available_bytes())
        tree_pss = 0
        for pid in [self.root, *descendants(self.root)]:
            try:
                name = process_name(pid)
                rss, pss = process_memory(pid)
            except (OSError, ValueError, IndexError):
                continue  # exited between the listing and the read
            self.peak_rss[name] = max(self.peak_rss.get(name, 0), rss)
            self.peak_pss[name] = max(self.peak_pss.get(name, 0), pss)
            tree_pss += pss
        self.peak_tree_pss = max(self.peak_tree_pss, tree_pss)
        self.samples += 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s)

        def gib(by_name: dict[str, int]) -> dict[str, float]:
            return {name: round(b / GiB, 3) for name, b in sorted(by_name.items(), key=lambda kv: -kv[1])}

        return {
            "min_available_gib": round(self.min_available / GiB, 3),
            "peak_rss_gib": gib(self.peak_rss),
            "peak_pss_gib": gib(self.peak_pss),
            "peak_tree_pss_gib": round(self.peak_tree_pss / GiB, 3),
            "memory_samples": self.samples,
        }


def run_rehearsal(
    out: Path, overrides: list[str], recipe: str = "configs/rehearsal_0_5b.yaml", timeout_s: float = 900
) -> dict:
    """Train ``recipe`` into ``out/rehearsal`` in a child process, sampling memory; the report."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "train",
        recipe,
        f"run.root={out}",
        "run.name=rehearsal",
        "run.console=plain",
        *overrides,
    ]
    before = mem_available_bytes()
    start = time.monotonic()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = MemorySampler(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the controller stops its processes on SIGTERM
            rc = proc.wait(timeout=120)
        memory = sampler.stop()
    wall = time.monotonic() - start
    run_dir = out / "rehearsal"
    report = {
        "recipe": recipe,
        "overrides": overrides,
        "returncode": rc,
        "wall_s": round(wall, 1),
        "available_at_start_gib": round(before / GiB, 3),
        **memory,
        "load_average_at_end": list(os.getloadavg()),
    }
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
        served = summary.get("publication_to_served", {})
        report.update(
            step_s=[round(s["step_s"], 2) for s in steps if s.get("type") == "step"],
            learner_step_s=summary.get("learner_step_s"),
            publication_to_served_s=served.get("total_s"),
            publication_to_served_stages_mean_s=served.get("mean_s"),
            run_peak_rss_gib={
                k: None if v is None else round(v / GiB, 3) for k, v in summary.get("peak_rss_bytes", {}).items()
            },
            run_min_mem_available_gib=None
            if summary.get("min_mem_available_bytes") is None
            else round(summary["min_mem_available_bytes"] / GiB, 3),
            summary=summary,
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/rehearsal", help="folder for the run directory and train.log")
    parser.add_argument("--recipe", default="configs/rehearsal_0_5b.yaml")
    parser.add_argument(
        "--result", default="bench/results/rehearsal.json", help="where to save the JSON ('none': nowhere)"
    )
    parser.add_argument("--timeout-s", type=float, default=900, help="the run is stopped past this")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the recipe (learner.total_steps=2)")
    args = parser.parse_args()
    report = run_rehearsal(Path(args.out), args.overrides, args.recipe, args.timeout_s)
    text = json.dumps(report, indent=2)
    if args.result != "none":
        Path(args.result).write_text(text + "\n")
    print(text)
    sys.exit(0 if report["returncode"] == 0 else 1)


if __name__ == "__main__":
    main()
