"""``asyncrl bench vs-trl``: both sides' records read onto one clock, and the comparison made on them."""

from __future__ import annotations

import json

import pytest

from asyncrl.benchmarks.vs_trl.report import compare, plot
from asyncrl.benchmarks.vs_trl.runs import read_asyncrl_run
from asyncrl.benchmarks.vs_trl.trl_side import read_trl_run
from asyncrl.benchmarks.vs_trl.workloads import WORKLOADS


def write_asyncrl_run(run_dir, accuracies, step_t=0.5, total_wall_s=30.0):
    """A run directory as the controller leaves it: steps from go, held-out rounds by version."""
    run_dir.mkdir(parents=True)
    steps = [{"version": v, "t": 1.0 + step_t * v, "wait_s": 0.1} for v in range(1, 9)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    evals = [{"type": "eval", "version": v, "exact_match": a, "wall_s": 0.5} for v, a in accuracies]
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    summary = {
        "phases_s": {"prepare": 1.0, "start": 10.0, "eval_before": 0.5, "train": 5.0, "stop": 2.0},
        "total_wall_s": total_wall_s,
        "learner_step_s": {"n": 8, "mean": 0.4},
        "trained": 512,
        "trained_tokens": 2048,
        "generator_busy_fraction": 0.5,
        "evals": evals,
        "dropped": {},
        "staleness_hist": {"0": 512},
        "reconciles": True,
        "publication_to_served": {"total_s": {"mean": 0.2}},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))


def write_trl_record(path, accuracies, eval_s=1.0):
    curve = [
        {"step": step, "accuracy": a, "t": 10.0 + step, "t_from_first_step": max(0.0, step - 1.0), "eval_s": eval_s}
        for step, a in accuracies
    ]
    path.write_text(
        json.dumps(
            {
                "curve": curve,
                "steps": [{"step": s, "t": 10.0 + s} for s in range(1, 9)],
                "t_first_step": 11.0,
                "train_s": 7.0,
                "eval_total_s": eval_s * len(curve),
                "samples": 512,
                "completion_tokens": 1024,
                "setup_marks": {"imported": 5.0, "data_loaded": 6.0, "trainer_built": 9.0},
                "sampler": "generate",
                "sampler_note": "",
                "versions": {},
                "trl_config": {},
                "mean_abs_param_change": 1e-3,
            }
        )
    )


def test_an_asyncrl_curve_is_placed_on_the_commands_clock(tmp_path):
    write_asyncrl_run(tmp_path / "run", [(0, 0.5), (4, 0.7), (8, 0.8)])
    run = read_asyncrl_run("async", 0, tmp_path / "run", wall_s=33.0)
    go = 3.0 + 1.0 + 10.0 + 0.5  # before the controller (33 - 30), prepare, start, eval before
    assert [(p.step, p.accuracy) for p in run.curve] == [(0, 0.5), (4, 0.7), (8, 0.8)]
    assert [p.t for p in run.curve] == pytest.approx([go, go + 3.0, go + 5.0])
    assert run.first_step_s == pytest.approx(go + 1.5) and run.train_s == pytest.approx(3.5)
    assert run.where["learner_steps_s"] == pytest.approx(3.2) and run.where["start_s"] == 10.0
    assert run.time_to(0.7) == pytest.approx(go + 3.0) and run.time_to(0.9) is None


def test_trl_gives_back_every_evaluation_of_the_benchmarks(tmp_path):
    write_trl_record(tmp_path / "trl.json", [(0, 0.5), (4, 0.75), (8, 0.8)], eval_s=1.0)
    run = read_trl_run(0, tmp_path / "trl.json", wall_s=25.0)
    assert run.command_s == pytest.approx(22.0)  # three held-out rounds of 1 s each taken off
    assert [p.t for p in run.curve] == pytest.approx([10.0, 14.0, 18.0])  # trl's own clock, without them
    assert run.final == 0.8 and run.samples_per_s() == pytest.approx(512 / 7.0)


def test_asyncrl_is_compared_with_trl_seed_by_seed(tmp_path):
    runs = []
    for seed, (trl_final, mine) in enumerate([(0.8, [(0, 0.5), (4, 0.8), (8, 0.85)]), (0.9, [(0, 0.5), (8, 0.85)])]):
        write_trl_record(tmp_path / f"trl{seed}.json", [(0, 0.5), (8, trl_final)])
        runs.append(read_trl_run(seed, tmp_path / f"trl{seed}.json", wall_s=20.0))
        write_asyncrl_run(tmp_path / f"a{seed}", mine)
        runs.append(read_asyncrl_run("async", seed, tmp_path / f"a{seed}", wall_s=33.0))
    figures = compare(runs)["async"]
    assert figures["reached_trl_final"] == 1  # seed 1 never reached trl's 0.9
    assert figures["s_to_trl_final_accuracy"] == {0: pytest.approx(17.5), 1: None}
    # trl's command: 20 s less its two held-out rounds of 1 s
    assert figures["s_to_trl_final_over_trl_command_s"]["median"] == pytest.approx(17.5 / 18.0)
    assert figures["accuracy_after"]["median"] == pytest.approx(0.85)
    plot(runs, tmp_path / "plot.png", "test")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_every_workload_loads_in_both_of_asyncrls_modes():
    for workload in WORKLOADS.values():
        sync = workload.config("sync")
        assert sync.buffer.max_staleness == 0 and sync.learner.broadcast_every == 1
        assert sync.buffer.sampler == "fifo" and sync.algorithm.std_estimator == "unbiased"
        assert workload.config("async").eval.every_versions


def test_a_record_keeps_the_runs_an_invocation_did_not_make(tmp_path, monkeypatch):
    """Seeds run one invocation at a time: each adds its runs to the record, replacing only its own."""
    from asyncrl.benchmarks.vs_trl import command

    monkeypatch.setattr(command, "machine", lambda threads: {"cpus": 2})
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()

    def place(side, seed, accuracies, wall_s):
        write_asyncrl_run(root / f"demo-{side}-s{seed}", accuracies)
        (root / f"demo-{side}-s{seed}.wall").write_text(f"{wall_s!r}\n")

    def report(seeds):
        argv = [
            "--workload",
            "demo",
            "--report-only",
            "--sides",
            "async",
            "sync",
            "--root",
            str(root),
            "--out",
            str(out),
        ]
        assert command.main([*argv, "--seeds", *map(str, seeds)]) == 0
        runs = json.loads((out / "vs_trl_demo.json").read_text())["runs"]
        return {(r["side"], r["seed"]): r["command_s"] for r in runs}

    place("async", 0, [(0, 0.5), (8, 0.8)], 33.0)
    place("sync", 0, [(0, 0.5), (8, 0.8)], 40.0)
    assert report([0]) == {("async", 0): 33.0, ("sync", 0): 40.0}
    for name in ("demo-async-s0", "demo-sync-s0"):  # the first runs' directories are gone
        (root / f"{name}.wall").unlink()
    place("sync", 1, [(0, 0.5), (8, 0.7)], 41.0)
    assert report([1]) == {("async", 0): 33.0, ("sync", 0): 40.0, ("sync", 1): 41.0}
    (root / "demo-sync-s1.wall").write_text("45.0\n")  # run again: replaces its own record only
    assert report([1]) == {("async", 0): 33.0, ("sync", 0): 40.0, ("sync", 1): 45.0}
