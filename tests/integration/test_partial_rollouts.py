"""Partial rollouts through the whole control plane (simulated engines, continuous generation):
with a staleness bound of one version and long-tailed answers spanning several updates, no sample
disappears: each is trained (its stale tokens masked), dropped with a reason, or held, answers
interrupted are resumed under the new version, and the ledger and the counters agree."""

import re

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller


@pytest.mark.slow  # real processes
@pytest.mark.parametrize("mode", ["mask", "resume"])
def test_partial_rollouts_are_accounted_for_and_the_ledger_reconciles(tmp_path, mode):
    cfg = load_config(
        "configs/bench_pipeline.yaml",
        [
            f"run.root={tmp_path}",
            "run.num_generators=2",
            "learner.total_steps=8",
            "learner.batch_groups=8",
            "buffer.max_staleness=1",
            f"generator.partial_rollouts={mode}",
        ],
    )
    summary = Controller(cfg).run()
    ledger, partial = summary["ledger"], summary["partial_rollouts"]
    assert summary["learner_steps"] == 8 and summary["reconciles"], summary
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, ledger
    # answers spanned updates, and their tokens past the bound were masked, not their groups dropped
    assert sum(n for k, n in summary["versions_per_sample"].items() if int(k) > 1) > 0, summary
    assert partial["stale_tokens_masked"] > 0 and ledger["stale_tokens_masked"] == partial["stale_tokens_masked"]
    assert ledger["trained"] == summary["trained"]  # samples with no token trained moved to dropped, stale
    assert ledger["dropped"].get("stale", 0) >= partial["stale_samples_dropped"]  # the gate's drops beside them
    assert max(int(k) for k in summary["token_staleness_hist"]) <= 1  # no token trained past the bound
    if mode == "resume":
        assert partial["resumed"] > 0 and ledger["resumed"] == partial["resumed"], (partial, ledger)
    else:
        assert partial["resumed"] == 0 and ledger["resumed"] == 0
    # and Prometheus says the same (each process's last exposition)
    exported = {"resumed": 0.0, "stale_tokens_masked": 0.0}
    for snapshot in (tmp_path / "bench" / "metrics").glob("*.prom"):
        if snapshot.stem == "controller":  # counts none; runs in this process, whose counters earlier tests moved
            continue
        for what, value in re.findall(
            r'^asyncrl_partial_rollouts_total\{what="(\w+)"\} (\S+)$', snapshot.read_text(), re.M
        ):
            exported[what] = exported.get(what, 0.0) + float(value)
    assert (
        exported["resumed"] == partial["resumed"] and exported["stale_tokens_masked"] == partial["stale_tokens_masked"]
    )
