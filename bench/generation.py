"""Benchmark: continuous batching against the batch barrier on one real vLLM engine, long-tailed answers.

The workload is the one that makes a batch barrier idle an engine: each group's answers are
exactly L tokens long (``min_tokens = max_tokens = L``, ``ignore_eos``, so the lengths are real),
L drawn per group from a lognormal (median 32, σ = 1, capped at 512; drawn by
``asyncrl.benchmarks.long_tail``, shared with the pipeline's four combinations). One engine (vLLM's
``AsyncLLM``, CPU build, the project's tiny model built with a context of ``--max-model-len``)
samples the same groups, with the same seeds, in two ways, both holding at most ``bound``
sequences:

- ``batch``: ``bound // n`` groups at a time, the next batch only when the slowest of this one is
  done (the generator loop's ``generator.mode: batch``);
- ``continuous``: a new group goes in as soon as one leaves (``generator.mode: continuous``,
  through the same ``VLLMStream`` the generator drives).

Repeats are interleaved (batch, continuous, continuous, batch, ...) so drift on a shared machine
hits both. Reported per run and as medians: generated tokens/s, and engine occupancy = mean
sequences the scheduler ran (vLLM's own per-step count, integrated over time) / bound. Goal:
continuous >= 1.5x batch tokens/s. Writes bench/results/generation.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/generation.py [--groups 48] [--n 8] [--bound 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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

from asyncrl.benchmarks.long_tail import addition_prompts as prompts  # noqa: E402
from asyncrl.benchmarks.long_tail import describe, draw_lengths  # noqa: E402
from asyncrl.generators.engine import EngineConfig, SamplingConfig  # noqa: E402


def run(stream, mode: str, texts: list[str], lengths: list[int], n: int, bound: int) -> dict:
    """Sample every group once in ``mode``; tokens/s and occupancy over the run."""
    per_batch = bound // n
    todo = list(range(len(texts)))
    running: set[str] = set()
    tokens = 0
    area0, start = stream.load.sequence_seconds(), time.monotonic()

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
        for key, completions, _greedy in stream.finished(timeout=1.0):
            running.discard(key)
            tokens += sum(len(c.response_ids) for c in completions)
    wall = time.monotonic() - start
    occupancy = (stream.load.sequence_seconds() - area0) / wall / bound
    expected = n * sum(lengths)
    if tokens != expected:
        raise RuntimeError(f"{mode}: {tokens} tokens generated, the workload has {expected}")
    return {
        "mode": mode,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "occupancy": round(occupancy, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=48, help="groups sampled per run")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--bound", type=int, default=64, help="most sequences in the engine (both modes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=640, help="the tiny model's context (prompt + 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench/results/generation.json"))
    args = parser.parse_args()
    if args.bound < args.n:
        raise SystemExit(f"--bound ({args.bound}) must be >= --n ({args.n}): room for one group at least")

    from asyncrl.generators.vllm_stream import build_stream
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    texts, lengths = prompts(args.groups, args.seed), draw_lengths(args.groups, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(TinyModelConfig(seed=args.seed, max_position_embeddings=args.max_model_len), tmp)
        engine_cfg = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=max(args.bound, 8))
        stream = build_stream(str(model), engine_cfg)
        try:
            capacity = stream.capacity()
            run(stream, "continuous", texts[:4], lengths[:4], args.n, args.bound)  # warm-up (first-use allocations)
            runs = []
            for r in range(args.repeats):
                order = ("batch", "continuous") if r % 2 == 0 else ("continuous", "batch")
                for mode in order:
                    runs.append({"repeat": r, **run(stream, mode, texts, lengths, args.n, args.bound)})
                    print(json.dumps(runs[-1]), flush=True)
            preempted = stream.load.preempted_all
        finally:
            stream.close()

    def median(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["mode"] == mode)

    summary = {
        m: {"tokens_per_s": median(m, "tokens_per_s"), "occupancy": median(m, "occupancy")}
        for m in ("batch", "continuous")
    }
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
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
            "bound_sequences": args.bound,
            "kv_capacity_sequences": capacity,
            "preemptions": preempted,
        },
        "runs": runs,
        "median": summary,
        "continuous_over_batch_tokens_per_s": round(
            summary["continuous"]["tokens_per_s"] / summary["batch"]["tokens_per_s"], 2
        ),
        "goal": "continuous >= 1.5x batch tokens/s",
        "machine": f"{os.cpu_count()} cores, shared with other jobs; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
        "commit": commit,
        "command": "OMP_NUM_THREADS=1 .venv/bin/python bench/generation.py " + " ".join(sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"median": summary, "ratio": out["continuous_over_batch_tokens_per_s"]}))


if __name__ == "__main__":
    main()
