"""Benchmark: continuous batching against the batch barrier on one real vLLM engine, long-tailed answers.

The workload is the one that makes a batch barrier idle an engine: each group's answers are
exactly L tokens long (``min_tokens = max_tokens = L``, ``ignore_eos``, so the lengths are real),
L drawn per group from a lognormal (median 32, σ = 1, capped at 512; drawn by
``asyncrl.benchmarks.long_tail``, shared with the pipeline's four combinations). One engine (vLLM's
``AsyncLLM``, CPU build, the project's tiny model built with a context of ``--max-model-len``)
samples the same groups, with the same seeds, in two ways, both holding at most ``bound``
sequences (each of ``--bounds`` in turn, one engine):

- ``batch``: ``bound // n`` groups at a time, the next batch only when the slowest of this one is
  done (the generator loop's ``generator.mode: batch``);
- ``continuous``: a new group goes in as soon as one leaves (``generator.mode: continuous``,
  through the same ``VLLMStream`` the generator drives).

Repeats are interleaved (batch, continuous, continuous, batch, ...) so drift on a shared machine
hits both. Reported per run and as medians: generated tokens/s, and engine occupancy = mean
sequences the scheduler ran (vLLM's own per-step count, integrated over time) / bound; both over
the whole run (the last groups drain the engine at the end) and over the steady part, from the
start until the last group goes in (the engine's own token count over that window: a generator in
a pipeline never runs out of prompts, so never drains). Goal: continuous >= 1.5x batch tokens/s.

The gain is the occupancy's only while a decode step costs the same however many sequences run
(an overhead- or memory-bound engine). On a CPU a step costs ``fixed + per_sequence x running``,
fitted here from the continuous runs (mean step = mean running / tokens/s): the fuller engine
takes longer steps, and the larger the bound the more of the occupancy gain that eats.
Writes bench/results/generation.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/generation.py [--groups 128] [--n 8] [--bounds 16 32 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402

from asyncrl.benchmarks.long_tail import addition_prompts as prompts  # noqa: E402
from asyncrl.benchmarks.long_tail import describe, draw_lengths  # noqa: E402
from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402
from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig  # noqa: E402


def run(stream, mode: str, texts: list[str], lengths: list[int], n: int, bound: int) -> dict:
    """Sample every group once in ``mode``; tokens/s and occupancy over the run."""
    per_batch = bound // n
    todo = list(range(len(texts)))
    running: set[str] = set()
    tokens = 0
    area0, start, tokens0 = stream.load.sequence_seconds(), time.monotonic(), stream.load.generated_tokens
    steady: tuple[float, float, int] | None = None  # (time, ∫ running dt, engine tokens) when the last group went in

    def submit(i: int) -> None:
        sampling = SamplingConfig(n=n, max_tokens=lengths[i])
        stream.submit(f"{mode}-{i}", texts[i], sampling, seed=i, min_tokens=lengths[i], ignore_eos=True)
        running.add(f"{mode}-{i}")

    while todo or running:
        if mode == "continuous":
            while todo and stream.running + n <= bound:
                submit(todo.pop(0))
        elif not running:  # batch: the next batch only once the whole previous one is done
            for _ in range(min(per_batch, len(todo))):
                submit(todo.pop(0))
        if not todo and steady is None:
            steady = (time.monotonic(), stream.load.sequence_seconds(), stream.load.generated_tokens)
        for key, completions, _greedy in stream.finished(timeout=1.0):
            running.discard(key)
            tokens += sum(len(c.response_ids) for c in completions)
    wall = time.monotonic() - start
    occupancy = (stream.load.sequence_seconds() - area0) / wall / bound
    steady_s = steady[0] - start
    expected = n * sum(lengths)
    if tokens != expected:
        raise RuntimeError(f"{mode}: {tokens} tokens generated, the workload has {expected}")
    return {
        "mode": mode,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "occupancy": round(occupancy, 3),
        "steady_s": round(steady_s, 3),
        "steady_tokens_per_s": round((steady[2] - tokens0) / steady_s, 1) if steady_s > 0 else None,
        "steady_occupancy": round((steady[1] - area0) / steady_s / bound, 3) if steady_s > 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=128, help="groups sampled per run")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument(
        "--bounds", type=int, nargs="+", default=[16, 32, 64], help="most sequences in the engine (both modes), each"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=640, help="the tiny model's context (prompt + 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench/results/generation.json"))
    args = parser.parse_args()
    if min(args.bounds) < args.n:
        raise SystemExit(f"--bounds ({args.bounds}) must be >= --n ({args.n}): room for one group at least")

    from asyncrl.generators.engines.vllm_stream import build_stream
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    texts, lengths = prompts(args.groups, args.seed), draw_lengths(args.groups, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(TinyModelConfig(seed=args.seed, max_position_embeddings=args.max_model_len), tmp)
        engine_cfg = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=max(*args.bounds, 8))
        stream = build_stream(str(model), engine_cfg)
        try:
            capacity = stream.capacity()
            run(stream, "continuous", texts[:4], lengths[:4], args.n, max(args.bounds))  # warm-up (first use)
            runs = []
            for bound in args.bounds:
                for r in range(args.repeats):
                    order = ("batch", "continuous") if r % 2 == 0 else ("continuous", "batch")
                    for mode in order:
                        runs.append({"bound": bound, "repeat": r, **run(stream, mode, texts, lengths, args.n, bound)})
                        print(json.dumps(runs[-1]), flush=True)
            preempted = stream.load.preempted
        finally:
            stream.close()

    def median(bound: int, mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["mode"] == mode and x["bound"] == bound)

    keys = ("tokens_per_s", "occupancy", "steady_tokens_per_s", "steady_occupancy")
    summary = {}
    for bound in args.bounds:
        summary[str(bound)] = per = {m: {k: median(bound, m, k) for k in keys} for m in ("batch", "continuous")}
        for key in ("tokens_per_s", "steady_tokens_per_s"):
            per[f"continuous_over_batch_{key}"] = round(per["continuous"][key] / per["batch"][key], 2)
    # Step cost: a continuous run holds its bound nearly all along, so mean step = running / tokens/s.
    cont = [x for x in runs if x["mode"] == "continuous"]
    running = np.array([x["occupancy"] * x["bound"] for x in cont])
    step_ms = np.array([1000 * x["occupancy"] * x["bound"] / x["tokens_per_s"] for x in cont])
    per_seq, fixed = np.polyfit(running, step_ms, 1) if len(set(x["bound"] for x in cont)) > 1 else (None, None)
    out = {
        "what": "generated tokens/s and engine occupancy, continuous batching vs the batch barrier, one vLLM engine",
        "workload": {
            "groups": args.groups,
            "n": args.n,
            "lengths": describe(),
            "length_median": statistics.median(lengths),
            "length_mean": round(statistics.mean(lengths), 1),
            "length_max": max(lengths),
            "tokens_per_run": args.n * sum(lengths),
        },
        "engine": {
            "model": "tiny Qwen2 (asyncrl.models.tiny), float32",
            "backend": "vLLM CPU build, AsyncLLM",
            "max_model_len": args.max_model_len,
            "bounds_sequences": args.bounds,
            "kv_capacity_sequences": capacity,
            "preemptions": preempted,  # every preemption vLLM reported
        },
        "runs": runs,
        "median_by_bound": summary,
        "continuous_over_batch_tokens_per_s": {b: summary[b]["continuous_over_batch_tokens_per_s"] for b in summary},
        "step_cost_fit_ms": None
        if fixed is None
        else {"fixed": round(float(fixed), 3), "per_sequence": round(float(per_seq), 4)},
        "goal": "continuous >= 1.5x batch tokens/s",
        "machine": f"{os.cpu_count()} cores, shared with other jobs; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
        "commit": measured_commit(),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python bench/generation.py " + " ".join(sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"continuous_over_batch_tokens_per_s": out["continuous_over_batch_tokens_per_s"]}))


if __name__ == "__main__":
    main()
