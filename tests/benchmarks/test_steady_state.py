import math
import os
import time

from asyncrl.benchmarks.steady_state import (
    SteadyStateMonitor,
    busy_seconds,
    by_role,
    cpu_seconds,
    longest_rollout_bound,
)


def test_cpu_seconds_reads_this_process_and_grows_with_work():
    before = cpu_seconds(f"/proc/{os.getpid()}/stat")
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert cpu_seconds(f"/proc/{os.getpid()}/stat") > before
    assert cpu_seconds("/proc/0/nonexistent") is None


def test_busy_seconds_sums_every_label_set():
    text = (
        "# TYPE asyncrl_busy_seconds_total counter\n"
        'asyncrl_busy_seconds_total{component="generators-0",role="generator"} 1.5\n'
        'asyncrl_busy_seconds_total{component="generators-1",role="generator"} 2.0\n'
        'asyncrl_busy_seconds_created{role="generator"} 1.7e+09\n'
    )
    assert busy_seconds(text) == 3.5
    assert by_role(
        {"generator-0": 1.0, "generator-1": 2.0, "buffer": 0.5},
        {"generator-0": "generator", "generator-1": "generator"},
    ) == {
        "generator": 3.0,
        "buffer": 0.5,
    }


def test_monitor_rejects_a_window_before_the_first_step():
    try:
        SteadyStateMonitor(object(), start_step=0)
    except ValueError as e:
        assert "start_step (0)" in str(e)
    else:
        raise AssertionError("start_step 0 accepted")


def _rollouts(counts: dict[str, int]) -> str:
    lines = ["# TYPE asyncrl_rollout_latency_seconds histogram"]
    lines += [f'asyncrl_rollout_latency_seconds_bucket{{le="{le}"}} {n}.0' for le, n in counts.items()]
    return "\n".join(lines) + "\n"


def test_the_longest_rollout_is_bounded_by_the_lowest_bucket_holding_every_observation():
    assert longest_rollout_bound(_rollouts({"0.25": 3, "0.5": 7, "1.0": 9, "2.5": 9, "+Inf": 9})) == 1.0
    assert longest_rollout_bound(_rollouts({"0.25": 0, "0.5": 0, "+Inf": 0})) == 0.0
    assert math.isinf(longest_rollout_bound(_rollouts({"0.25": 1, "30.0": 1, "+Inf": 2})))
    assert longest_rollout_bound("asyncrl_busy_seconds_total 3.0\n") == 0.0  # no histogram: no bound needed
