"""The whole control plane with simulated engines: four generators, reward worker, buffer,
dispatcher and learner loop as real processes, a few seconds of simulated work."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.benchmarks.measured_run import run_measured
from asyncrl.benchmarks.pipeline import capacities
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.controller.process import Controller
from asyncrl.observability.inspect_run import inspect_run
from asyncrl.observability.plot import staleness_histogram


@pytest.mark.slow  # real processes
def test_simulated_fleet_runs_async_within_the_staleness_bound_and_reconciles(tmp_path, capsys):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "learner.total_steps=8",
            "sampling.max_tokens=128",
            "buffer.max_staleness=2",
            "logging.samples_per_step=2",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 8 and summary["reconciles"], summary
    assert all(v == 0 for v in summary["unaccounted_by_link"].values())
    assert summary["eval_before"] is None  # a simulated learner has no model to evaluate
    assert max(int(k) for k in summary["staleness_hist"]) <= 2
    assert sum(summary["staleness_hist"].values()) == summary["trained"] == 8 * 16 * 8
    assert summary["latency_s"]["p95"] >= summary["latency_s"]["p50"] > 0
    assert len(summary["generator_versions"]) == 4 and set(summary["generator_versions"].values()) == {8}
    # Resource figures: every process's peak RSS, the learner's step times, and for the final
    # version the seconds from its publication to each generator serving it, with their stages.
    assert set(summary["peak_rss_bytes"]) == {"controller", "buffer", "dispatcher", "learner", "reward-0"} | {
        f"generator-{i}" for i in range(4)
    }
    assert all(v > 10 << 20 for v in summary["peak_rss_bytes"].values()), summary["peak_rss_bytes"]
    assert summary["peak_rss_total_bytes"] >= summary["peak_rss_bytes"]["learner"]
    assert summary["min_mem_available_bytes"] > 0
    assert (
        summary["learner_step_s"]["n"] == 8 and summary["learner_step_s"]["max"] >= summary["learner_step_s"]["p50"] > 0
    )
    served = summary["publication_to_served"]
    assert set(served["versions"]["8"]) == {f"generator-{i}" for i in range(4)}
    for record in served["versions"]["8"].values():
        assert record["total_s"] >= record["reload_s"] > 0  # the simulated engine's load takes its 10 ms
        assert record["total_s"] >= record["gather_s"] + record["transport_out_s"]

    # Every process's exposition passes the real promtool, and the scrape config lists them all.
    run_dir = tmp_path / "bench"
    promtool = find_promtool()
    snapshots = sorted((run_dir / "metrics").glob("*.prom"))
    assert {p.stem for p in snapshots} == {"controller", "buffer", "dispatcher", "learner", "reward-0"} | {
        f"generator-{i}" for i in range(4)
    }
    for snapshot in snapshots:
        check = subprocess.run([promtool, "check", "metrics"], input=snapshot.read_bytes(), capture_output=True)
        assert check.returncode == 0, (snapshot.name, check.stdout, check.stderr)
    scrape = yaml.safe_load((run_dir / "prometheus.yml").read_text())
    components = {t["labels"]["component"] for t in scrape["scrape_configs"][0]["static_configs"]}
    assert components == {p.stem for p in snapshots}
    check = subprocess.run([promtool, "check", "config", str(run_dir / "prometheus.yml")], capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr

    # Every metric the Grafana dashboard queries is exported by some process (GPU memory: only
    # where CUDA runs, so not here).
    exported = {line.split()[2] for p in snapshots for line in p.read_text().splitlines() if line.startswith("# TYPE")}
    exported |= {"asyncrl_gpu_memory_allocated_bytes", "asyncrl_gpu_memory_reserved_bytes"}
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "configs/grafana/asyncrl-dashboard.json").read_text())
    queried = {
        re.sub(r"_(bucket|count|sum)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"asyncrl_[a-z_]+", target["expr"])
    }
    assert queried <= exported | {name.removesuffix("_total") for name in exported} | {
        name + "_total" for name in exported
    }, queried - exported

    # One JSON line per learner step, and the curves drawn from them.
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == list(range(1, 9))
    assert all(s["tokens"] > 0 and "accuracy" in s for s in steps)

    # The console printed one line per step (stdout is no terminal here), TensorBoard has every
    # step at its learner version.
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [f"{v}/8" for v in range(1, 9)]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/reward")] == list(range(1, 9))
    assert main(["plot", str(run_dir)]) == 0 and (run_dir / "plots.png").stat().st_size > 10_000

    # Two whole groups of every step's batch, one line per answer, with text, reward and versions;
    # on TensorBoard's text tab too, and printed by inspect --samples.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    n = cfg.sampling.n
    assert sorted({r["version"] for r in samples}) == list(range(1, 9)) and len(samples) == 8 * 2 * n
    assert all(r["reward"] is not None and r["completion"] and r["prompt"] for r in samples)
    assert all(0 <= r["staleness"] <= 2 and r["policy_version"] == r["version"] - 1 - r["staleness"] for r in samples)
    assert "samples/text_summary" in events.Tags()["tensors"]
    assert sum(staleness_histogram(run_dir, {}).values()) == summary["trained"]  # from the learner's metrics

    # inspect: every process is down now, and shows the counters it last exported.
    state = inspect_run(run_dir)
    assert not any(row["up"] for name, row in state.items() if name != "run")
    assert state["run"]["finished"] and state["run"]["step"] == 8 and state["controller"]["version"] == 8
    assert main(["inspect", str(run_dir)]) == 0
    run_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run "))
    assert run_row.split()[1] == "done" and "reconciles=True" in run_row and " step=8 " in run_row, run_row
    assert state["learner"]["samples"]["trained"] == summary["trained"] and state["learner"]["version"] == 8
    assert sum(state[f"generator-{i}"]["samples"]["generated"] for i in range(4)) == summary["generated"]
    assert main(["inspect", str(run_dir), "--samples", "3"]) == 0
    assert capsys.readouterr().out.count("\n-- ") == 3


def find_promtool() -> str:
    """Debian's promtool, unpacked by scripts/setup.sh into .tools/ (or one on PATH)."""
    local = Path(__file__).resolve().parents[2] / ".tools/prometheus/usr/bin/promtool"
    found = str(local) if local.exists() else shutil.which("promtool")
    assert found, "promtool is missing: scripts/setup.sh unpacks Debian's prometheus package into .tools/"
    return found


@pytest.mark.slow  # real processes
def test_truncated_answers_dropped_at_the_buffer_are_counted_and_reconcile(tmp_path):
    """``algorithm.truncation.mode: drop`` through the real processes: groups holding an answer cut
    at ``sampling.max_tokens`` (the simulated lengths reach it often) are dropped by the buffer
    under ``truncated``, the dispatcher refills their slots, and every sample and group reconciles."""
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "learner.total_steps=4",
            "sampling.max_tokens=256",
            "algorithm.truncation.mode=drop",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 4 and summary["reconciles"], summary
    assert summary["dropped"].get("truncated", 0) > 0, summary["dropped"]
    assert summary["ledger"]["dropped"]["truncated"] == summary["dropped"]["truncated"]
    assert summary["ledger"]["lost"] == 0


def test_capacities_come_from_the_timing_models():
    cfg = load_config(
        "configs/bench_pipeline.yaml", ["simulation.generator.length_sigma=0", "simulation.generator.length_median=10"]
    )
    cap = capacities(cfg, draws=3)
    assert cap["mean_response_tokens"] == 10
    assert cap["generator_mode"] == "continuous" and cap["generation_samples_per_s"] > cap["sync_samples_per_s"] > 0


@pytest.mark.slow  # real processes
def test_several_simulated_engines_share_a_process_and_the_steady_state_is_measured(tmp_path):
    cfg = load_config(
        "configs/bench_scale.yaml",
        [
            f"run.root={tmp_path}",
            "run.num_generators=4",
            "simulation.generator.engines_per_process=2",
            "learner.batch_groups=8",
            "learner.total_steps=8",
            "sampling.max_tokens=128",
        ],
    )
    m = run_measured(cfg)
    # Two processes, each one generator to the controller, both serving the final version.
    assert m["generator_versions"] == {"generators-0": 8, "generators-1": 8}
    assert m["counters_reconcile"] and m["samples_per_s"] > 0 and m["wall_s"] > 0
    assert 0 < m["generator_busy_fraction"] < 1.5 and 0 < m["learner_busy_fraction"] < 1
    assert set(m["cpu_us_per_sample"]) == {"controller", "dispatcher", "reward", "buffer", "learner", "generator"}
    assert m["cpu_us_per_sample"]["reward"] > 0 and m["messages_per_s"] > 0
    logs = sorted(p.name for p in (tmp_path / "scale" / "logs").iterdir())
    assert [n for n in logs if n.startswith("generator")] == ["generators-0.log", "generators-1.log"]


@pytest.mark.slow  # real processes
def test_auto_staleness_moves_the_bound_by_the_signals_and_the_run_reconciles(tmp_path):
    """``buffer.max_staleness: auto`` through the real processes. The simulated learner's signals
    make a sample d versions stale cost KL 0.02·d: healthy up to d = 2 (margin 0.9 of kl_max 0.05),
    a breach at 3. A slow learner keeps the generators ahead, so samples reach the bound. The
    bound climbs 1 → 2 → 3, is cut back at 3, and climbs again; each batch is within the bound
    its request carried (the one set after the step before), and everything reconciles."""
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "learner.total_steps=16",
            "sampling.max_tokens=128",
            "simulation.learner.s_per_token=1.0e-4",
            "simulation.learner.behaviour_kl_per_version=0.02",
            "buffer.max_staleness=auto",
            "buffer.auto_staleness={min: 1, max: 4, start: 1, raise_after: 1, margin: 0.9, kl_max: 0.05}",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 16 and summary["reconciles"], summary
    assert all(v == 0 for v in summary["unaccounted_by_link"].values())
    assert summary["ledger"]["lost"] == 0
    steps = [json.loads(line) for line in (tmp_path / "bench" / "steps.jsonl").read_text().splitlines()]
    bounds = [s["staleness_bound"] for s in steps]
    reasons = [s.get("staleness_bound_reason", "") for s in steps]
    assert all(1 <= b <= 3 for b in bounds), bounds  # 4 is never reached: 3 breaches
    assert any(r.startswith("raise 2 -> 3") for r in reasons), reasons
    assert any(r.startswith("lower 3 -> 1: kl 0.06 > 0.05") for r in reasons), reasons
    in_force = [1] + bounds[:-1]  # a batch is gated by the bound its request carried
    assert all(s["staleness_max"] <= b for s, b in zip(steps, in_force)), list(zip(steps, in_force))
    assert max(int(k) for k in summary["staleness_hist"]) <= 3
    prom = (tmp_path / "bench" / "metrics" / "learner.prom").read_text()
    assert 'asyncrl_staleness_bound{component="learner"}' in prom
    assert 'asyncrl_staleness_bound_changes_total{direction="lower"}' in prom
