"""Metric names, the component label, /metrics and /health, GPU memory gauges."""

import subprocess
import sys
import types
import urllib.request

from prometheus_client import generate_latest

import asyncrl.observability.metrics as m
from asyncrl.observability.step_stats import StepStats
from tests.integration.test_simulated_pipeline import find_promtool

ISSUE_NAMES = {
    "asyncrl_rollout_latency_seconds": "histogram",
    "asyncrl_reward_duration_seconds": "histogram",
    "asyncrl_learner_step_duration_seconds": "histogram",
    "asyncrl_staleness": "histogram",
    "asyncrl_buffer_items": "gauge",
    "asyncrl_dropped_total": "counter",
    "asyncrl_weight_sync_duration_seconds": "histogram",
    "asyncrl_policy_version": "gauge",
    "asyncrl_generated_tokens_total": "counter",
    "asyncrl_busy_seconds_total": "counter",
    "asyncrl_last_step_timestamp_seconds": "gauge",
    "asyncrl_mismatch_kl": "gauge",
}


def exposition() -> str:
    return generate_latest(m.REGISTRY).decode()


def test_every_metric_the_issue_names_is_exported_with_its_type():
    types_ = dict(line.split()[2:4] for line in exposition().splitlines() if line.startswith("# TYPE"))
    for name, kind in ISSUE_NAMES.items():
        assert types_.get(name) == kind, name


def test_component_label_is_this_process_name(monkeypatch):
    monkeypatch.setattr(m, "_component", "generator-3")
    m.POLICY_VERSION.set(7)
    m.BUSY_SECONDS.inc(1.5)
    assert m.REGISTRY.get_sample_value("asyncrl_policy_version", {"component": "generator-3"}) == 7
    assert m.REGISTRY.get_sample_value("asyncrl_busy_seconds_total", {"component": "generator-3"}) >= 1.5


def stats(**measured) -> StepStats:
    return StepStats(version=1, loss=0.0, tokens=8, staleness_mean=0.0, staleness_max=0, **measured)


def test_learner_step_sets_timestamp_and_mismatch_kl():
    m.record_learner_step(stats(mismatch_kl=0.0125))
    assert m.REGISTRY.get_sample_value("asyncrl_mismatch_kl") == 0.0125
    assert m.REGISTRY.get_sample_value("asyncrl_last_step_timestamp_seconds") > 1.7e9
    m.record_learner_step(stats())  # a batch without on-policy samples keeps the last value
    assert m.REGISTRY.get_sample_value("asyncrl_mismatch_kl") == 0.0125


def test_learner_step_sets_the_clip_fractions_by_side_and_the_ppo_kl():
    m.record_learner_step(stats(clipfrac_high=0.25, clipfrac_low=0.125, clipfrac_dual=0.0, ppo_kl=0.002))
    for side, value in (("high", 0.25), ("low", 0.125), ("dual", 0.0)):
        assert m.REGISTRY.get_sample_value("asyncrl_clip_fraction", {"side": side}) == value
    assert m.REGISTRY.get_sample_value("asyncrl_ppo_kl") == 0.002


def test_weight_sync_stages_are_one_metric():
    m.WEIGHT_BROADCAST_SECONDS.observe(0.2)
    m.WEIGHT_APPLY_SECONDS.observe(0.1)
    for stage in ("publish", "apply"):
        assert m.REGISTRY.get_sample_value("asyncrl_weight_sync_duration_seconds_count", {"stage": stage}) >= 1


def test_exposition_passes_promtool_and_serves_health(tmp_path):
    port = m.serve_metrics(tmp_path, "learner")
    assert (tmp_path / "metrics" / "learner.port").read_text() == str(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
        assert resp.read() == b"ok\n"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read()
    assert b"# TYPE asyncrl_policy_version gauge" in text
    check = subprocess.run([find_promtool(), "check", "metrics"], input=text, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    snapshot = m.write_metrics_snapshot(tmp_path, "learner")
    assert snapshot.read_bytes().startswith(b"# HELP")


def test_no_gpu_gauges_without_cuda_and_no_torch_import(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert "asyncrl_gpu_memory" not in exposition()
    assert "torch" not in sys.modules  # a scrape does not import torch


def test_gpu_gauges_where_cuda_is_initialised(monkeypatch):
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        device_count=lambda: 2,
        memory_allocated=lambda i: 100 * (i + 1),
        memory_reserved=lambda i: 200 * (i + 1),
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=1 << 30),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert m.REGISTRY.get_sample_value("asyncrl_gpu_memory_allocated_bytes", {"device": "1"}) == 200
    assert m.REGISTRY.get_sample_value("asyncrl_gpu_memory_reserved_bytes", {"device": "0"}) == 200
    assert m.REGISTRY.get_sample_value("asyncrl_gpu_memory_total_bytes", {"device": "0"}) == 1 << 30
    check = subprocess.run([find_promtool(), "check", "metrics"], input=exposition().encode(), capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
