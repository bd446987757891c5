"""DAPO's dynamic sampling through the real processes (simulated engines): groups whose answers
all score alike are dropped at the buffer with reason ``zero_variance``, the dispatcher refills
their slots, the learner still gets full batches within the staleness bound, every group
reconciles by id, and a resumed run counts on from its checkpoint."""

import json
import re

import pytest

from asyncrl.cli import main

pytestmark = pytest.mark.slow  # two whole runs of real processes

OVERRIDES = [
    "run.num_generators=2",
    "run.console=quiet",
    "learner.total_steps=6",
    "sampling.max_tokens=64",
    "learner.batch_groups=8",
    "checkpoint.every_steps=3",
    "buffer.max_staleness=2",
    "buffer.zero_variance.drop=true",
    # 90 % right per answer, 8 answers: 0.9^8 = 43 % of the groups are answered right every time.
    "simulation.generator.accuracy=0.9",
]


def zero_variance_metric(run_dir) -> float:
    text = (run_dir / "metrics" / "buffer.prom").read_text()
    return sum(
        float(v) for v in re.findall(r'^asyncrl_zero_variance_groups_total\{reward="[^"]+"\} (\S+)$', text, re.M)
    )


def test_zero_variance_groups_are_dropped_refilled_counted_and_count_on_after_a_resume(tmp_path):
    run_dir = tmp_path / "dapo"
    assert main(["train", "configs/bench_pipeline.yaml", f"run.root={tmp_path}", "run.name=dapo", *OVERRIDES]) == 0
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["learner_steps"] == 6 and first["reconciles"], first
    assert first["trained"] == 6 * 8 * 8  # every step a full batch, though 4 groups in 10 were filtered
    assert max(int(k) for k in first["staleness_hist"]) <= 2
    zv = first["zero_variance"]
    assert zv["groups"] >= 10 and zv["samples"] == 8 * zv["groups"] == first["dropped"]["zero_variance"]
    assert set(zv["by_reward"]) <= {"1", "0"} and zv["by_reward"]["1"] > 0  # all right: too easy
    assert 0.2 < zv["fraction"] < 0.7
    ledger = first["ledger"]
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0
    assert ledger["dropped"]["zero_variance"] == first["dropped"]["zero_variance"]  # each by id, once
    assert zero_variance_metric(run_dir) == zv["groups"]

    # The checkpoint holds the counts; the resumed run counts on from them.
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    held = json.loads((checkpoint / "buffer" / "header.json").read_text())["zero_variance"]
    assert 0 < held["groups"] <= zv["groups"]
    assert main(["train", "--resume", str(run_dir), "learner.total_steps=12"]) == 0
    second = json.loads((run_dir / "summary.json").read_text())
    assert second["learner_steps"] == 12 and second["reconciles"], second
    assert second["zero_variance"]["groups"] > held["groups"]
    assert second["dropped"]["zero_variance"] == 8 * second["zero_variance"]["groups"]
    assert zero_variance_metric(run_dir) == second["zero_variance"]["groups"]
    assert second["ledger"]["lost"] == 0 and second["ledger"]["trained_twice"] == 0
    assert second["ledger"]["restores"] == 1
    # The ledger counts on across the resume, by id: more than the first run left in it, and more
    # than the resumed run dropped itself (a ledger begun anew would hold those alone). How many
    # the resumed run drops depends on how many groups the checkpoint's buffer held, so no ratio.
    kept = second["ledger"]["dropped"]["zero_variance"]
    assert kept > first["ledger"]["dropped"]["zero_variance"]
    assert kept > 8 * (second["zero_variance"]["groups"] - held["groups"])
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == list(range(1, 13))
