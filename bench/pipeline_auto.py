"""Throughput of ``buffer.max_staleness: auto`` against a fixed η = 4, side by side in
``asyncrl bench pipeline`` (the real control plane under simulated engines).

Each fleet runs the pipeline bench's ``async-4`` and ``auto`` modes, alternated over
``--repeats`` (the order flips each repeat, so drift of a shared machine's load falls on both),
and reports the samples/s of each, their ratio (auto / η = 4, the median over repeats), the same
in trained tokens/s (prompt + response, from each run's ``steps.jsonl`` over the same steady
window), each run's fraction of its ideal (an upper bound: ``asyncrl.benchmarks.capacity``), the
mean staleness and, for auto, the bounds it set. Tokens matter where the learner is
the bottleneck: there samples/s moves with the mean length trained, and a lower bound drops more
stale samples, which are the long ones (they took longest to generate). The fleets:

- ``balanced``: ``configs/bench_pipeline.yaml`` as it is (generation ~ training capacity), the
  simulated learner's behaviour KL 0: nothing holds the bound down;
- ``balanced_kl``: the same, with a behaviour KL of 0.005 per version of staleness
  (``simulation.learner.behaviour_kl_per_version``): with ``kl_max`` 0.05 and margin 0.5 the
  bound may rise while the stalest samples' KL stays <= 0.025 (staleness 5) and holds above;
- ``generation_bound``: the learner 2.5x faster (``simulation.learner.s_per_token=2e-5``), where
  every version of lead the generators get is throughput, with the same KL per version.

    OMP_NUM_THREADS=1 .venv/bin/python bench/pipeline_auto.py            # ~8 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/pipeline_auto.py --fleets balanced --repeats 1

Prints one JSON object and writes it to ``{out}/pipeline_auto.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.benchmarks.measured_run import warmup_steps  # noqa: E402
from asyncrl.benchmarks.pipeline import run_mode  # noqa: E402
from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402
from asyncrl.config import load_config  # noqa: E402

RECIPE = "configs/bench_pipeline.yaml"
FLEETS: dict[str, list[str]] = {
    "balanced": [],
    "balanced_kl": ["simulation.learner.behaviour_kl_per_version=0.005"],
    "generation_bound": ["simulation.learner.behaviour_kl_per_version=0.005", "simulation.learner.s_per_token=2e-5"],
}
"""Fleet -> the dotted overrides of the pipeline bench's recipe."""

MODES = ("async-4", "auto")


def trained_tokens(run_dir: Path, warm: int) -> dict:
    """Trained tokens/s and tokens per sample (prompt + response: what the learner's step costs)
    from a run's ``steps.jsonl``, over the steady window ``run_measured`` uses (after ``warm`` steps)."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    wall = steps[-1]["t"] - steps[warm - 1]["t"]
    tokens, samples = sum(s["tokens"] for s in steps[warm:]), sum(s["samples"] for s in steps[warm:])
    return {"trained_tokens_per_s": tokens / wall, "trained_tokens_per_sample": tokens / samples}


def figures(run: dict, tokens: dict) -> dict:
    """What the comparison keeps of one ``run_mode`` result."""
    out = {
        "samples_per_s": run["samples_per_s"],
        **tokens,
        "staleness_mean": run["staleness_mean"],
        "staleness_hist": run["staleness_hist"],
        "generator_busy_fraction": run["generator_busy_fraction"],
        "learner_busy_fraction": run["learner_busy_fraction"],
        "ideal_samples_per_s": run["ideal_samples_per_s"],
        "fraction_of_ideal": run["fraction_of_ideal"],
        "fraction_of_ideal_error": run["fraction_of_ideal_error"],
        "dropped": run["dropped"],
    }
    if "staleness_bounds" in run:
        bounds = [b for b in run["staleness_bounds"] if b is not None]
        out["bound_mean"] = statistics.fmean(bounds) if bounds else None
        out["bound_last"] = bounds[-1] if bounds else None
        out["bound_changes"] = run["staleness_bound_changes"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fleets", nargs="+", default=list(FLEETS), choices=list(FLEETS))
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode per fleet, order alternated")
    parser.add_argument("--out", default="runs/pipeline_auto")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = parser.parse_args()
    out = Path(args.out)
    started = time.perf_counter()
    result: dict = {"commit": measured_commit(), "recipe": RECIPE, "fleets": {}}
    for fleet in args.fleets:
        overrides = [*FLEETS[fleet], *args.overrides]
        cfg = load_config(RECIPE, overrides)
        runs: dict = {m: [] for m in MODES}
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                run = run_mode(RECIPE, overrides, mode, out / fleet / f"r{r}")
                runs[mode].append(figures(run, trained_tokens(out / fleet / f"r{r}" / mode, warmup_steps(cfg))))
                print(f"{fleet} r{r} {mode:8s} {run['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
        rate = {m: statistics.median(x["samples_per_s"] for x in runs[m]) for m in MODES}
        tokens = {m: statistics.median(x["trained_tokens_per_s"] for x in runs[m]) for m in MODES}
        result["fleets"][fleet] = {
            "overrides": overrides,
            "fraction_of_ideal": {m: statistics.median(x["fraction_of_ideal"] for x in runs[m]) for m in MODES},
            "samples_per_s": rate,
            "auto_over_eta4": rate["auto"] / rate["async-4"],
            "trained_tokens_per_s": tokens,
            "auto_over_eta4_tokens": tokens["auto"] / tokens["async-4"],
            "ratio_by_repeat": [a["samples_per_s"] / f["samples_per_s"] for a, f in zip(runs["auto"], runs["async-4"])],
            "runs": runs,
        }
    result["seconds"] = time.perf_counter() - started
    result["note"] = "median over repeats; machine shared with other jobs (each repeat runs both modes back to back)"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_auto.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
