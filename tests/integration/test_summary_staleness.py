"""``summary.json`` describes the staleness of what was trained (simulated engines, continuous
generation, weights swapped in flight, no partial rollouts): samples by staleness, tokens by the
staleness of the version that sampled each, and samples by how many versions sampled them, each
adding up to what the run trained."""

import json

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller


@pytest.mark.slow  # real processes
def test_summary_carries_the_staleness_histograms_and_the_versions_per_sample(tmp_path):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.num_generators=2",
            "learner.total_steps=8",
            "learner.batch_groups=8",
            "buffer.max_staleness=2",
        ],
    )
    assert cfg.generator.mode == "continuous" and cfg.weights.apply_mode == "in_flight"
    returned = Controller(cfg).run()
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary["reconciles"] and summary["trained"] == returned["trained"]
    samples = {int(k): v for k, v in summary["staleness_hist"].items()}
    tokens = {int(k): v for k, v in summary["token_staleness_hist"].items()}
    versions = {int(k): v for k, v in summary["versions_per_sample"].items()}  # samples by versions that sampled them
    assert sum(samples.values()) == summary["trained"] == 8 * 8 * 8  # steps x groups x n, none reused
    assert max(samples) <= 2 and max(tokens) <= 2  # within the bound, counted from the oldest segment
    assert sum(tokens.values()) == summary["trained_tokens"]  # every trained token at its own version
    assert sum(versions.values()) == summary["trained"]
    assert versions[1] > 0 and sum(v for k, v in versions.items() if k > 1) > 0  # updates came mid-answer
    assert list(versions) == sorted(versions) and {1, 2} <= set(versions)  # exact counts, in order
    assert max(tokens) <= max(samples)  # a sample's tokens are never staler than its oldest segment
