"""Benchmark: how far vLLM's behaviour logprobs are from the learner's, at identical weights.

Every staleness correction leans on the ratio pi_learner / mu_behaviour being 1 when the weights
are the same; numerics make it not quite 1. This measures the gap for a real model: one vLLM
engine (CPU build) samples answers at temperature 1 for prompts of a task, the learner's model
(transformers, the same folder) recomputes the logprobs of the sampled tokens, and per token
(Δ_t = log pi_t − log mu_t, over tokens sampled from mu):

- ``k1`` = mean(−Δ) and ``k3`` = mean(exp(Δ) − 1 − Δ): two estimators of KL(mu ‖ pi) per token
  (k3 is the learner's ``mismatch_kl`` step statistic, on its staleness-0 tokens);
- mean and max |Δ|;
- the probe's calibration, ``asyncrl.weights.probe``: the mean |Δ| over the probe text.

For each pair of dtypes (engine, learner) in ``--pairs``. bfloat16 on a CPU without AVX512-BF16
is emulated (~30x slower), so keep ``--prompts`` small there. Writes bench/results/mismatch_kl.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/mismatch_kl.py --model smollm2-135m-instruct [--prompts 16] [--n 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def learner_logprobs(model, prompt_ids, response_ids) -> np.ndarray:
    """(T,) float64 logprobs the HF ``model`` gives ``response_ids`` after ``prompt_ids`` (temperature 1)."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0, len(prompt_ids) - 1 : -1]  # (T, V)
    picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(list(response_ids))[:, None])[:, 0]
    return picked.double().numpy()


def measure(model_dir: str, engine_dtype: str, learner_dtype: str, prompts: list[str], n: int, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig, VLLMEngine
    from asyncrl.weights.probe import learner_probe

    max_len = 512
    engine = VLLMEngine(model_dir, EngineConfig(dtype=ENGINE_DTYPES[engine_dtype], max_model_len=max_len))
    try:
        start = time.perf_counter()
        groups = engine.generate(prompts, SamplingConfig(n=n, temperature=1.0, max_tokens=max_tokens), seed=0)
        sample_s = time.perf_counter() - start
        tok = AutoTokenizer.from_pretrained(model_dir)
        dtype = torch.float32 if learner_dtype == "fp32" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        probe = learner_probe(model, tok, max_len=max_len)
        served = engine.score(probe["prompt"], probe["continuation_ids"])
        probe_noise = float(np.mean(np.abs(np.asarray(served, np.float64) - np.asarray(probe["logprobs"]))))
        deltas = []
        start = time.perf_counter()
        for group in groups:
            for c in group:
                pi = learner_logprobs(model, c.prompt_ids, c.response_ids)
                deltas.append(pi - c.logprobs.astype(np.float64))
        score_s = time.perf_counter() - start
    finally:
        engine.close()
    d = np.concatenate(deltas)
    return {
        "engine_dtype": engine_dtype,
        "learner_dtype": learner_dtype,
        "tokens": int(d.size),
        "k1_kl_per_token": float(np.mean(-d)),
        "k3_kl_per_token": float(np.mean(np.expm1(d) - d)),
        "mean_abs_logprob_diff": float(np.mean(np.abs(d))),
        "max_abs_logprob_diff": float(np.max(np.abs(d))),
        "probe_noise": probe_noise,
        "probe_tokens": len(probe["continuation_ids"]),
        "sample_s": sample_s,
        "learner_score_s": score_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder, or a known model's name")
    parser.add_argument("--data", default="data/word_arithmetic/test.jsonl.gz", help="prompts (a 'question' per row)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pairs", nargs="+", default=["fp32:fp32", "bf16:bf16", "fp32:bf16"])
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "mismatch_kl.json"))
    args = parser.parse_args()

    from asyncrl.models.fetch import resolve_model_path
    from asyncrl.tasks.sources import read_jsonl

    model_dir = str(resolve_model_path(args.model))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = read_jsonl(REPO / args.data)[: args.prompts]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": r["question"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    results = []
    for pair in args.pairs:
        engine_dtype, learner_dtype = pair.split(":")
        results.append(measure(model_dir, engine_dtype, learner_dtype, prompts, args.n, args.max_tokens))
        print(json.dumps(results[-1]), flush=True)
        gc.collect()
    out = {
        "benchmark": "mismatch_kl",
        "model": args.model,
        "prompts": len(prompts),
        "n": args.n,
        "max_tokens": args.max_tokens,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "avx512_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text(),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
