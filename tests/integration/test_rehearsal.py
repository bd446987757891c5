"""The rehearsal at a real size (configs/rehearsal_0_5b.yaml: 494 M parameters, vLLM CPU
generator, DeepSpeed ZeRO-2 learner, shared-memory weights), one learner step, run by
bench/rehearsal.py so that free memory and each process's memory are sampled from /proc.

It asserts that the run finishes and reconciles, that the figures a real run is judged by are
there and sane, and that the machine kept >= 3 GiB free. Random weights learn nothing, so
nothing here is about rewards. One step is what only this size can show (memory, a publication of
494 M parameters served); that later versions follow the first is the pipeline tests' at small size.

The engine runs ``bfloat16_if_native`` rather than the recipe's bfloat16: where bf16 is emulated
(AVX2-only CPUs) generation, the held-out evaluations and the probe's prefill are ~30x slower
in bf16: the whole rehearsal took 353 s there in bf16 and 178 s in fp32 on an idle machine. In fp32
the engine holds ~2 GB more (peak 9.1 GB, against 7.3), which the 3 GiB floor below still checks
(5.9 GiB stayed free).
Where bf16 is native, this is the recipe as shipped.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 1
MIN_FREE_GIB = 3.0
GiB = 1 << 30
RUN_BOUND_S = 1800
"""Seconds the whole rehearsal may take: start-up, an evaluation and two ZeRO-2 steps of a 494 M
model on two CPU cores took 220 s on a CPU with native bf16 and 561 s on an AVX2-only one (the
learner in fp32 there, ``bf16_if_native``: in emulated bf16 one step lasted over 10 min; the
engine's emulated bf16 makes generation the slow side). Three times the slower leaves room for a
loaded machine."""

# ~17 GB resident and the 3 GiB it must leave free: no other slow test runs beside it.
pytestmark = [pytest.mark.timeout(RUN_BOUND_S + 120), pytest.mark.alone]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("rehearsal")
    done = subprocess.run(
        [
            sys.executable,
            "bench/rehearsal.py",
            "--out",
            str(out),
            "--result",
            "none",
            f"learner.total_steps={STEPS}",
            "engine.dtype=bfloat16_if_native",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_S,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{(out / 'train.log').read_text()[-5000:]}"
    return json.loads(done.stdout)


@pytest.mark.slow
def test_rehearsal_runs_and_accounts_for_every_sample(rehearsal):
    summary = rehearsal["summary"]
    assert summary["learner_steps"] == STEPS
    assert summary["reconciles"], summary
    assert summary["generated"] == (
        summary["trained"] + sum(summary["dropped"].values()) + summary["buffered_at_end"] + summary["in_flight_at_end"]
    )
    assert all(v == 0 for v in summary["unaccounted_by_link"].values()), summary
    assert summary["trained"] == STEPS * 2 * 4  # steps x batch_groups x n
    assert summary["generator_versions"] == {"generator-0": STEPS}
    assert summary["deaths"] == []


@pytest.mark.slow
def test_rehearsal_reports_step_time_memory_and_publication_to_served(rehearsal):
    summary = rehearsal["summary"]
    assert summary["learner_step_s"]["n"] == STEPS and summary["learner_step_s"]["mean"] > 0
    assert len(rehearsal["step_s"]) == STEPS and all(s > 0 for s in rehearsal["step_s"])
    # every version reached the generator, timed from the learner's publication to its serving it
    served = summary["publication_to_served"]
    assert sorted(served["versions"]) == [str(v) for v in range(1, STEPS + 1)]
    assert all(set(gens) == {"generator-0"} for gens in served["versions"].values())
    records = [r for gens in served["versions"].values() for r in gens.values()]
    assert all(0 < r["total_s"] and r["reload_s"] > 0 for r in records), records
    # each process's peak: the learner holds at least the 494 M weights and an fp32 copy (3 GB in
    # bf16, 4 GB in fp32), the generator the weights (1 GB or 2 GB); neither can exceed the machine
    peaks = {name: b / GiB for name, b in summary["peak_rss_bytes"].items()}
    assert set(peaks) == {"controller", "buffer", "dispatcher", "reward-0", "learner", "generator-0"}
    assert 2.5 < peaks["learner"] < 24 and 0.9 < peaks["generator-0"] < 24, peaks
    # the machine kept >= 3 GiB free all along, model build and evaluations included
    assert rehearsal["memory_samples"] > 10
    assert rehearsal["min_available_gib"] >= MIN_FREE_GIB, rehearsal
    assert summary["min_mem_available_bytes"] >= MIN_FREE_GIB * GiB
