"""``bench/learner.py --ranks`` at a tiny size: groups of 1 and 2 learner ranks at ZeRO-3 train,
report their figures and check the partitioning claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
"""Seconds the bench may take: two groups (three processes) each import DeepSpeed and step twice."""


def test_ranks_bench_reports_throughput_memory_and_publication(tmp_path):
    out = tmp_path / "ranks.json"
    argv = [sys.executable, "bench/learner.py", "--ranks", "--shape", "tiny", "--stages", "3"]
    argv += ["--groups", "2", "--group-size", "2", "--prompt", "4", "--response", "8", "--steps", "1"]
    argv += ["--publish-repeats", "1", "--bucket-mb", "0.01", "--out", str(out)]
    proc = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["cpus"] >= 1 and report["parameters"] > 0
    zero3 = report["stages"]["zero3"]
    for ranks, count in (("ranks_1", 1), ("ranks_2", 2)):
        group = zero3[ranks]
        assert group["tokens_per_s"] > 0
        assert len(group["peak_rss_bytes_per_rank"]) == len(group["held_bytes_per_rank"]) == count
        for held in group["held_bytes_per_rank"]:
            assert held["total"] == held["params"] + held["master"] + held["moments"]
            assert min(held["params"], held["moments"]) > 0
            assert held["master"] == 0  # fp32: the master partition is the parameters' own storage
    # ZeRO-3 partitions parameters and moments: each of two ranks holds about half
    assert zero3["held_ratio"] <= 0.6
    assert report["claim"] == {"zero3_held_ratio": zero3["held_ratio"], "bound": 0.6, "pass": True}
    publication = zero3["publication"]
    assert publication["buckets"] >= 2
    assert publication["faster_of_rank0_and_own_buckets"] in ("rank0_publishes", "own_buckets")
    packed = publication["bytes_packed_per_rank"]
    assert packed["rank0_publishes"][1] == 0 and packed["rank0_publishes"][0] > 0
    assert sum(packed["own_buckets"]) == packed["rank0_publishes"][0]
    assert all(t > 0 for t in (publication["rank0_publishes_s"], publication["own_buckets_s"]))
