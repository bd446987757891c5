"""Each transport and schedule through the real control plane, with simulated engines (fast)."""

import json

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller

pytestmark = pytest.mark.slow  # whole runs of real processes, one per transport


@pytest.mark.parametrize(
    "transport, schedule, mode, apply_mode",
    [
        ("zmq", "staleness", "batch", "between_requests"),
        ("shm", "every_k", "continuous", "in_flight"),  # a background thread swaps while the engine samples
        ("file", "every_s", "batch", "between_requests"),
    ],
)
def test_every_generator_ends_on_the_final_version(tmp_path, transport, schedule, mode, apply_mode):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.num_generators=2",
            "learner.total_steps=6",
            "sampling.max_tokens=32",
            "buffer.max_staleness=3",
            f"weights.transport={transport}",
            f"weights.schedule={schedule}",
            f"generator.mode={mode}",
            f"weights.apply_mode={apply_mode}",
            "weights.every_s=0.2",
            "weights.bucket_mb=0.25",
        ],
    )
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 6 and summary["reconciles"], summary
    assert set(summary["generator_versions"].values()) == {6}
    assert max(int(k) for k in summary["staleness_hist"]) <= 3
    learner = (tmp_path / "bench" / "metrics" / "learner.prom").read_text()
    count = next(
        line
        for line in learner.splitlines()
        if line.startswith('asyncrl_weight_sync_duration_seconds_count{stage="publish"}')
    )
    assert float(count.split()[-1]) >= 2
    if schedule == "staleness":  # publish when versions would reach the bound - margin: steps 2, 4, 6
        assert float(count.split()[-1]) == 3
    gen = (tmp_path / "bench" / "metrics" / "generator-0.prom").read_text()
    assert (
        'asyncrl_weight_sync_duration_seconds_count{stage="apply"}' in gen
        and 'asyncrl_policy_version{component="generator-0"} 6.0' in gen
    )
    assert json.loads((tmp_path / "bench" / "summary.json").read_text())["learner_steps"] == 6
