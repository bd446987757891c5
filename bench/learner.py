"""Benchmark of the learner's step at a real vocabulary (151,936): memory per token, and tokens/s.

    OMP_NUM_THREADS=1 .venv/bin/python bench/learner.py   # CPU: memory
    bash bench/gpu_learner.sh                                     # a GPU machine: throughput (and memory)

Each variant runs in a fresh child process on the same model and the same batch, built in this
run, one warm-up step first (AdamW's moments are allocated on the first step):

- ``full_logits``: ``PolicyTrainer.train_step`` with the scoring the trainer had before
  ``asyncrl.learner.logprobs``: the model's (B, L, V) logits, then ``token_logprobs`` and the
  entropy over all of them (the in-bench baseline, copied here as it was);
- ``asyncrl``: ``PolicyTrainer.train_step`` as it is (response positions only, the LM head
  ``learner.trainer.logits_chunk_tokens`` at a time, recomputed in the backward; packed micro
  batches with ``--micro-batch-tokens``);
- ``plain``: a plain PyTorch loop on the same batch, the reference of the throughput goal: fp32
  weights, ``torch.autocast`` bf16 on CUDA, full logits, the same decoupled PPO loss, AdamW,
  gradient clipping (no DeepSpeed).

Memory: ``peak_bytes``, the step's peak over the memory held just before it. On the CPU the
peak is the process's resident set high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before the step: torch's CPU allocator keeps no statistics, and
``tracemalloc`` does not see it); on CUDA ``torch.cuda.max_memory_allocated``. That peak also
holds what does not grow with the batch (gradients, the optimizer's temporaries, one chunk of
logits); ``peak_bytes_per_token`` divides it by the batch's tokens (prompt + response, padding
excluded), and ``memory_ratio`` = full_logits' / asyncrl's on the same batch (goal >= 3). On the
CPU each variant also runs at half the batch: ``peak_bytes_per_added_token`` = (peak - peak at
half) / (tokens - tokens at half) is how the peak grows with the batch.
Throughput: real tokens per second of the timed steps (median step time).

CPU mode (default): a small Qwen2 (hidden 256, 4 layers) with the vocabulary padded to 151,936
and tied embeddings, fp32, 4 (and 2) sequences of 64 + 192 tokens, logits 128 tokens at a time:
``full_logits`` against ``asyncrl``. ``--device cuda``: the Qwen2.5-0.5B shape (24 layers, hidden 896,
14/2 heads, MLP 4,864, vocabulary 151,936) in bf16, 8 sequences of 2,048 tokens (``--lengths
full``: 512 prompt + 1,536 response each; ``rl``: the same prompts, answers of 64 (or a quarter of the longest)..1,536 tokens,
padded to 2,048 by the plain loop, packed by asyncrl), ``plain`` against ``asyncrl``; goal
``speedup`` >= 1.5. One JSON object on stdout, also written to ``--out``.

``--ranks``: the learner group of one rank against two (``learner.ranks``) on the same model and
global batch, at ZeRO-2 and ZeRO-3: tokens/s, peak RSS and the parameters + optimizer state each
rank holds, and the ways of publishing the weights under ZeRO-3 (``bench/learner_ranks.py``, which
takes the options after it).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "cuda" not in sys.argv:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

VOCAB = 151_936
SHAPES = {
    # ``TinyModelConfig`` fields; 0.5b is Qwen2.5-0.5B's shape (as configs/rehearsal_0_5b.yaml)
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
}


def build_model(shape: str, out_dir: Path, max_len: int) -> Path:
    """A randomly initialised Qwen2 of ``shape`` with the Qwen2.5 vocabulary, saved in fp32."""
    from transformers import Qwen2ForCausalLM

    from asyncrl.models.tiny import TinyModelConfig, qwen2_config

    cfg = TinyModelConfig(
        **SHAPES[shape],
        vocab_size=VOCAB,
        max_position_embeddings=max(max_len, 64),
        tie_word_embeddings=True,  # as Qwen2.5-0.5B
    )
    config = qwen2_config(cfg, rope_theta=1_000_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def count_parameters(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return sum(int(np.prod(f.get_slice(key).get_shape())) for key in f.keys())


def make_groups(args) -> list:
    """The batch: ``args.batch`` samples in groups of up to 4, the same in every child (seeded)."""
    from asyncrl.wire.schema import Group, Sample

    rng = np.random.default_rng(0)
    groups, index = [], 0
    while index < args.batch:
        n = min(4, args.batch - index)
        prompt = rng.integers(2, VOCAB, args.prompt).astype(np.int32)
        samples = []
        for i in range(n):
            T = (
                args.response
                if args.lengths == "full"
                else int(rng.integers(min(64, args.response // 4), args.response + 1))
            )
            ids = rng.integers(2, VOCAB, T).astype(np.int32)
            logprobs = np.full(T, -np.log(VOCAB), np.float32)  # ~ the random model's uniform sampler
            samples.append(Sample(f"{index + i}", ids, logprobs, "", "stop", float(i % 2)))
        groups.append(Group(f"g{len(groups)}", f"p{len(groups)}", "t", "", "", prompt, 0, "gen", samples))
        index += n
    return groups


# -- memory -------------------------------------------------------------------------------------


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class PeakMeter:
    """The peak memory of a region over what was held when it began, in bytes."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.before = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.before
        else:
            self.peak = _status_kib("VmHWM") * 1024 - self.before


# -- the variants -------------------------------------------------------------------------------


def full_logits_score(trainer):
    """The trainer's scoring before asyncrl.learner.logprobs: (B, L, V) logits, all of them."""
    from asyncrl.learner.batch import token_logprobs
    from asyncrl.learner.logprobs import TokenScores

    def score(micro, entropy, plan=None):
        out = trainer.engine(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False)
        logprobs = token_logprobs(out.logits, micro.input_ids, trainer.cfg.temperature)  # (b, l-1)
        with torch.no_grad():  # entropy_coef 0: the old code computed it without gradient
            z = out.logits[:, :-1].float() / trainer.cfg.temperature  # (b, l-1, V)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            ent = lse.squeeze(-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        return TokenScores(logprobs, ent, torch.zeros_like(logprobs))

    return score


def run_trainer(args, variant: str) -> dict:
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import PolicyTrainer

    cfg = TrainerConfig(
        zero_stage=args.zero_stage,
        dtype=args.dtype,
        lr=1e-5,
        micro_batch_size=args.batch,
        micro_batch_tokens=args.micro_batch_tokens if variant == "asyncrl" else None,
        logits_chunk_tokens=args.chunk_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = PolicyTrainer(args.model_dir, cfg)
    if variant == "full_logits":
        trainer.score = full_logits_score(trainer)
    groups = make_groups(args)
    return measure(args, lambda: trainer.train_step(groups), extra=lambda stats: {"padding_frac": stats.padding_frac})


def run_plain(args) -> dict:
    """A plain PyTorch loop: autocast bf16 on CUDA (fp32 on the CPU), full logits, AdamW."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.advantages import grpo_advantages
    from asyncrl.learner.batch import collate, token_logprobs
    from asyncrl.learner.losses import decoupled_ppo_loss

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(device).train()
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    groups = make_groups(args)
    rewards = np.array([[s.reward for s in g.samples] for g in groups], dtype=np.float32)
    batch = collate(groups, grpo_advantages(rewards), pad_id=0).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = token_logprobs(logits, batch.input_ids)  # float32 (B, L-1)
        loss, _ = decoupled_ppo_loss(lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, batch.response_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {}

    return measure(args, step)


def measure(args, step, extra=None) -> dict:
    groups = make_groups(args)
    tokens = sum(len(g.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    seconds, peaks, stats = [], [], {}
    for _ in range(args.steps):
        with PeakMeter(args.device) as meter:
            start = time.perf_counter()
            stats = step()
            sync()
            seconds.append(time.perf_counter() - start)
        peaks.append(meter.peak)
    median = statistics.median(seconds)
    out = {
        "tokens": tokens,
        "step_seconds": [round(s, 4) for s in seconds],
        "tokens_per_s": tokens / median,
        "peak_bytes": max(peaks),
        "peak_bytes_per_token": max(peaks) / tokens,
    }
    if extra is not None:
        out.update(extra(stats))
    return out


def child_main(args) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.child == "plain":
        result = run_plain(args)
    else:
        result = run_trainer(args, args.child)
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent ---------------------------------------------------------------------------------


def run_child(args, variant: str, batch: int | None = None) -> dict:
    """One variant in a fresh process; ``batch`` overrides the number of sequences."""
    argv = [sys.executable, __file__, "--child", variant, "--model-dir", str(args.model_dir)]
    for key in (
        "device",
        "dtype",
        "zero_stage",
        "batch",
        "prompt",
        "response",
        "lengths",
        "chunk_tokens",
        "warmup",
        "steps",
    ):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if batch is not None:
        argv[argv.index("--batch") + 1] = str(batch)
    if args.micro_batch_tokens:
        argv += ["--micro-batch-tokens", str(args.micro_batch_tokens)]
    if args.gradient_checkpointing:
        argv += ["--gradient-checkpointing"]
    env = dict(os.environ)
    for key in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)  # each child is its own one-process group
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"variant {variant} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    if "--ranks" in sys.argv[1:]:
        # The learner group of 1 and 2 ranks: its own options (bench/learner_ranks.py --help).
        from learner_ranks import main as ranks_main

        ranks_main([arg for arg in sys.argv[1:] if arg != "--ranks"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ranks", action="store_true", help="the learner group of 1 and 2 ranks instead (bench/learner_ranks.py)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: small on cpu, 0.5b on cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--batch", type=int, help="sequences (default 4 on cpu, 8 on cuda)")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default 64 on cpu, 512 on cuda)")
    parser.add_argument("--response", type=int, help="(longest) response tokens (default 192 on cpu, 1536 on cuda)")
    parser.add_argument("--lengths", choices=("full", "rl"), default="full")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        help="learner.trainer.logits_chunk_tokens (default 128 on cpu, the config's on cuda)",
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="asyncrl only: packing budget")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--variants", nargs="+", help="default: full_logits asyncrl (cpu), plain asyncrl (cuda)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default bench/results/learner.json (learner_gpu.json on cuda)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.shape = args.shape or ("0.5b" if cuda else "small")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.batch = args.batch or (8 if cuda else 4)
    args.prompt = args.prompt or (512 if cuda else 64)
    args.response = args.response or (1536 if cuda else 192)
    if args.chunk_tokens is None:
        from asyncrl.learner.config import TrainerConfig

        args.chunk_tokens = TrainerConfig().logits_chunk_tokens if cuda else 128
    if args.child:
        child_main(args)
        return
    variants = args.variants or (["plain", "asyncrl"] if cuda else ["full_logits", "asyncrl"])
    out_path = args.out or ROOT / "bench" / "results" / ("learner_gpu.json" if cuda else "learner.json")
    with tempfile.TemporaryDirectory(prefix="bench_learner_") as tmp:
        args.model_dir = build_model(args.shape, Path(tmp) / "model", args.prompt + args.response)
        params = count_parameters(args.model_dir / "model.safetensors")
        results = {}
        for variant in variants:
            results[variant] = run_child(args, variant)
            if args.device == "cpu" and args.batch >= 2:
                # How the peak grows with the batch, apart from what does not (the gradients, the
                # optimizer's temporaries, one chunk of logits).
                half = run_child(args, variant, batch=args.batch // 2)
                big = results[variant]
                big["half_batch"] = half
                big["peak_bytes_per_added_token"] = (big["peak_bytes"] - half["peak_bytes"]) / (
                    big["tokens"] - half["tokens"]
                )
    report = {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "shape": args.shape,
        "parameters": params,
        "vocab_size": VOCAB,
        "dtype": args.dtype,
        "zero_stage": args.zero_stage,
        "batch": args.batch,
        "prompt_tokens": args.prompt,
        "response_tokens": args.response,
        "lengths": args.lengths,
        "logits_chunk_tokens": args.chunk_tokens,
        "micro_batch_tokens": args.micro_batch_tokens,
        "gradient_checkpointing": args.gradient_checkpointing,
        "measured_steps": args.steps,
        "variants": results,
    }
    if "full_logits" in results and "asyncrl" in results:
        before, after = results["full_logits"], results["asyncrl"]
        report["memory_ratio"] = before["peak_bytes_per_token"] / after["peak_bytes_per_token"]
        report["memory_goal_met"] = report["memory_ratio"] >= 3.0
    if "plain" in results and "asyncrl" in results:
        report["speedup"] = results["asyncrl"]["tokens_per_s"] / results["plain"]["tokens_per_s"]
        report["memory_ratio_vs_plain"] = results["plain"]["peak_bytes"] / results["asyncrl"]["peak_bytes"]
        if cuda:
            report["speedup_goal_met"] = report["speedup"] >= 1.5
    report["load_average"] = os.getloadavg()
    report["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    text = json.dumps(report, indent=2)
    print(text)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text + "\n")


if __name__ == "__main__":
    main()
