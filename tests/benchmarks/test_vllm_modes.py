"""The four-combination driver on a scripted engine stream: admission, swaps and what the learner counts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from asyncrl.benchmarks.long_tail import CAP, draw_lengths
from asyncrl.benchmarks.timed_learner import Rollout, TimedLearner
from asyncrl.benchmarks.vllm_modes import Driver, ModesBenchConfig, summarize, trained_figures
from asyncrl.generators.completion import Completion


class _Load:
    def __init__(self):
        self.area = 0.0
        self.generated_tokens = 0

    def sequence_seconds(self) -> float:
        return self.area


class _Engine:
    def __init__(self, stream):
        self.stream, self.version, self.swaps_with_running = stream, 0, 0

    def load_weights(self, weights_dir, version: int) -> float:
        self.version = version
        if self.stream.groups:
            self.swaps_with_running += 1
        for g in self.stream.groups.values():  # a new segment at the token each sequence reached
            g["segments"].append([g["done"], version])
        return 0.0


class ScriptedStream:
    """One token per running group per ``finished`` call; a group is done at its ``max_tokens``."""

    def __init__(self):
        self.engine, self.load, self.groups = _Engine(self), _Load(), {}

    @property
    def running(self) -> int:
        return sum(g["n"] for g in self.groups.values())

    def submit(self, key, prompt, sampling, seed=None, min_tokens=None, ignore_eos=False):
        assert ignore_eos and min_tokens == sampling.max_tokens and seed is not None  # seeded, as a generator's
        self.groups[key] = {
            "n": sampling.n,
            "len": sampling.max_tokens,
            "done": 0,
            "segments": [[0, self.engine.version]],
        }

    def finished(self, timeout):
        time.sleep(0.001)  # a decode step: the learner's thread runs meanwhile, as beside a real engine
        self.load.area += self.running
        self.load.generated_tokens += self.running
        out = []
        for key, g in list(self.groups.items()):
            g["done"] += 1
            if g["done"] >= g["len"]:
                del self.groups[key]
                segs = [s for s in g["segments"] if s[0] < g["len"]]
                comp = Completion(
                    np.zeros(3, np.int32),
                    np.zeros(g["len"], np.int32),
                    np.zeros(g["len"], np.float32),
                    "",
                    "length",
                    segs,
                )
                out.append((key, [comp] * g["n"], None))
        return out

    def abort(self, keys):
        for k in keys:
            self.groups.pop(k, None)


def _run(timing: str, mode: str, eta: int = 2):
    cfg = ModesBenchConfig(n=2, bound=8, batch_groups=4, max_staleness=eta, warmup_steps=1, steps=4)
    lengths = [1 + (i * 7) % 6 for i in range(200)]
    stream = ScriptedStream()
    learner = TimedLearner(4, eta if timing == "async" else 0, 0.0, 5, wait_s=30)
    gen = Driver(stream, "weights", cfg, ["1+1="] * 200, lengths).run(mode, learner)
    return learner, gen, stream


@pytest.mark.parametrize("mode", ["continuous", "batch"])
def test_sync_trains_each_batch_at_the_version_that_sampled_it(mode):
    learner, gen, stream = _run("sync", mode)
    assert len(learner.steps) == 5 and learner.version == 5
    for s in learner.steps:
        assert set(s["staleness"]) == {0} and s["versions_per_sample"] == {1: 8}
    assert (
        stream.engine.swaps_with_running == 0 and gen["weight_swaps"] >= 4
    )  # one per step (the last may come after the end)


def test_async_continuous_swaps_in_flight_and_stays_within_eta():
    learner, gen, stream = _run("async", "continuous", eta=2)
    staleness = [x for s in learner.steps for x in s["staleness"]]
    assert max(staleness) <= 2 and learner.dropped_stale == 0
    assert stream.engine.swaps_with_running > 0
    spanning = sum(n for s in learner.steps for k, n in s["versions_per_sample"].items() if k > 1)
    assert spanning > 0  # an answer sampled across a swap keeps both segments
    for s in learner.steps:  # every trained token counted once, at the staleness of its own version
        assert sum(s["token_staleness"].values()) == s["tokens"]


def test_async_batch_swaps_only_between_batches():
    learner, gen, stream = _run("async", "batch", eta=2)
    assert stream.engine.swaps_with_running == 0
    assert all(s["versions_per_sample"] == {1: 8} for s in learner.steps)


def test_learner_drops_a_group_past_eta_and_waits_for_fresh_ones():
    learner = TimedLearner(batch_groups=1, max_staleness=0, s_per_token=0.0, total_steps=1, version=3)
    learner.put(Rollout(0, tokens=2, samples=1, segments=[[[0, 2]]], lengths=[2]))
    learner.put(Rollout(1, tokens=3, samples=1, segments=[[[0, 3]]], lengths=[3]))
    learner.run()
    assert learner.error is None and learner.dropped_stale == 1
    assert learner.steps[0]["tokens"] == 3 and learner.version == 4
    assert learner.admits(1) and not learner.admits(2)  # (version - start + 0 + 1) * 1 groups


def test_summary_splits_the_gain_into_continuous_batching_and_overlap():
    rates = {"async-continuous": 90.0, "async-batch": 40.0, "sync-continuous": 45.0, "sync-batch": 30.0}
    combos = {k: {"trained_tokens_per_s": v} for k, v in rates.items()}
    alone = {
        "continuous": {"generated_tokens_per_s": 95.0, "steady_tokens_per_s": 100.0},
        "batch": {"generated_tokens_per_s": 50.0, "steady_tokens_per_s": 50.0},
    }
    out = summarize(ModesBenchConfig(), alone, alone, 0.01, combos)  # a learner of 100 tokens/s
    assert out["ideal_tokens_per_s"] == {"continuous": 100.0, "batch": 50.0}  # each mode's own capacity
    assert out["combinations"]["async-batch"]["fraction_of_ideal"] == 0.8  # of the barrier's 50, not of 100
    assert out["combinations"]["async-continuous"]["fraction_of_ideal"] == 0.9
    assert out["learner_sized_to"].startswith("1 x the continuous") and out["async_continuous_over_sync_batch"] == 3.0
    split = out["gain_split"]
    assert split["continuous_batching"] == 1.5 and split["overlap"] == 2.0
    assert split["continuous_share_of_log_gain"] + split["overlap_share_of_log_gain"] == pytest.approx(1.0)


def test_the_ideal_takes_the_faster_alone_run_and_states_their_spread():
    rates = {"async-continuous": 90.0, "async-batch": 40.0, "sync-continuous": 45.0, "sync-batch": 30.0}
    combos = {k: {"trained_tokens_per_s": v} for k, v in rates.items()}
    before = {"continuous": {"steady_tokens_per_s": 95.0}, "batch": {"steady_tokens_per_s": 50.0}}
    after = {"continuous": {"steady_tokens_per_s": 100.0}, "batch": {"steady_tokens_per_s": 40.0}}
    out = summarize(ModesBenchConfig(), before, after, 0.001, combos)  # a learner of 1000 tokens/s
    assert out["ideal_tokens_per_s"] == {"continuous": 100.0, "batch": 50.0}  # an upper bound: the faster run
    assert out["combinations"]["async-continuous"]["fraction_of_ideal_error"] == pytest.approx(0.05)
    assert out["combinations"]["sync-batch"]["fraction_of_ideal_error"] == pytest.approx(0.2)


def test_trained_figures_measure_after_the_fill():
    learner = TimedLearner(1, 0, 0.5, 3)
    learner.steps = [
        {
            "t": t,
            "tokens": 10,
            "samples": 2,
            "staleness": [0, 0],
            "token_staleness": {0: 10},
            "versions_per_sample": {1: 2},
        }
        for t in (5.0, 7.0, 9.0)
    ]
    fig = trained_figures(learner, warmup=1, start=0.0)
    assert fig["trained_tokens_per_s"] == 20 / 4.0 and fig["fill_s"] == 5.0
    assert fig["staleness_hist"] == {0: 4} and fig["learner_busy_fraction"] == 0.5 * 20 / 4.0


def test_long_tail_lengths_are_within_the_cap_with_median_32():
    lengths = draw_lengths(4000, seed=1)
    assert 1 <= min(lengths) and max(lengths) <= CAP and 30 <= float(np.median(lengths)) <= 34


def test_the_long_tail_workload_needs_the_real_engine(tmp_path):
    from asyncrl.benchmarks.pipeline import main

    with pytest.raises(ValueError, match="--workload long-tail needs --engine vllm"):
        main(["--workload", "long-tail", "--out", str(tmp_path)])


def test_a_config_typo_names_the_key():
    from asyncrl.benchmarks.vllm_modes import load_modes_config

    assert load_modes_config("configs/bench_vllm_modes.yaml", ["steps=3"]).steps == 3
    with pytest.raises(ValueError, match="stpes"):
        load_modes_config("configs/bench_vllm_modes.yaml", ["stpes=3"])


def test_an_alone_run_reports_its_steady_rate_until_the_last_group_goes_in():
    cfg = ModesBenchConfig(n=2, bound=8, batch_groups=4)
    stream = ScriptedStream()
    run = Driver(stream, "weights", cfg, ["1+1="] * 20, [1 + (i * 7) % 6 for i in range(20)]).run(
        "continuous", None, 20
    )
    assert run["steady_tokens_per_s"] > 0 and run["aborted_at_end"] == 0
    assert stream.load.generated_tokens == run["generated_tokens"]  # every token of the 20 groups, drain included


def test_an_alone_run_whose_groups_all_fit_at_once_has_no_steady_rate():
    cfg = ModesBenchConfig(n=2, bound=8, batch_groups=4)
    run = Driver(ScriptedStream(), "weights", cfg, ["1+1="] * 4, [3, 4, 5, 6]).run("continuous", None, 4)
    assert run["steady_tokens_per_s"] is None and run["generated_tokens_per_s"] > 0  # capacity() takes the latter
