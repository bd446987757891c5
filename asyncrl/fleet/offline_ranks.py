"""The ranks of a multi-rank offline run (``asyncrl sft``/``dpo`` with ``training.ranks`` > 1).

One process per rank, ``python -m asyncrl.learner.offline.loop RUN_DIR [--resume]``, each with
the rendezvous RL's learner ranks get (``asyncrl.fleet.launcher.learner_rank_env``: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT on this machine) and the environment of every
component (``asyncrl.controller.preparation.child_env``'s one thread, offline). The wait is
bounded by ``timeout_s``; a rank that fails ends the others (they would wait in a collective until
``collective_timeout_s``), and the error names it with the tail of its output. Rank 0 prints
the progress to this process's stdout (and ``RUN_DIR/rank0.log`` holds nothing then); the other
ranks' output goes to ``RUN_DIR/rank{r}.log``. The summary is rank 0's ``RUN_DIR/summary.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.fleet.launcher import learner_rank_env
from asyncrl.wire.endpoints import free_ports


def run_offline_ranks(run_dir: Path, ranks: int, resume: bool, timeout_s: float) -> dict:
    """Run the ranks to their end; rank 0's summary. A failure (or ``timeout_s`` passed) stops
    every rank and raises ``RuntimeError`` naming the rank and its output's tail."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "asyncrl.learner.offline.loop", str(run_dir)] + (["--resume"] if resume else [])
    logs = [run_dir / f"rank{rank}.log" for rank in range(ranks)]
    procs = []
    for rank, (rank_env, path) in enumerate(zip(learner_rank_env(ranks, free_ports(1)[0]), logs)):
        with open(path, "w") as out:
            stdout = None if rank == 0 else out
            procs.append(subprocess.Popen(command, env={**env, **rank_env}, stdout=stdout, stderr=out))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rank = failed[0] if failed else 0
                why = f"exited with {procs[rank].returncode}" if failed else f"ran past {timeout_s:g} s"
                raise RuntimeError(f"offline rank {rank} {why}; its output ends:\n{_tail(logs[rank])}")
            time.sleep(0.5)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(
                f"offline rank {failed[0]} exited with {procs[failed[0]].returncode}:\n{_tail(logs[failed[0]])}"
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
    summary = run_dir / "summary.json"
    if not summary.is_file():
        raise RuntimeError(f"offline rank 0 wrote no {summary}:\n{_tail(logs[0])}")
    return json.loads(summary.read_text())


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no output)"
