"""Benchmark: the learner on a real model with LoRA adapters against full fine-tuning.

    OMP_NUM_THREADS=1 .venv/bin/python bench/learner_lora.py [--model smollm2-135m-instruct] [--steps 3]

Each variant (``full``: ``model.lora`` null; ``lora``: ``model.lora.rank`` R on the attention
and MLP projections) runs in a fresh child process, on the same model and the same batch of
random-token groups (``--groups`` x ``--n`` samples, ``--prompt`` + ``--response`` tokens),
``PolicyTrainer`` at ``--zero-stage`` (default 2, the demo's), fp32, one warm-up step first
(AdamW's moments are allocated on the first step), then ``--steps`` timed steps. Per variant:

- ``step_s``: the timed steps' seconds (and their median);
- ``rss_after_build_bytes``: the process's resident set once the trainer is built (the model,
  the DeepSpeed engine); ``rss_after_warmup_bytes``: after the warm-up step (the moments exist);
  ``step_peak_bytes``: a timed step's peak resident set over what was held before it
  (``VmHWM`` reset through ``/proc/self/clear_refs``: torch's CPU allocator keeps no statistics);
  ``process_peak_bytes``: the process's high-water mark, build included;
- ``trainable_params``, ``optimizer_state_bytes`` (AdamW's moments and any master copies);
- ``publish_bytes`` and ``publish_s``: what one version sends (``weight_buckets``, copied to the
  host as a transport does) and how long gathering and copying it takes;
- ``checkpoint_bytes`` and ``checkpoint_s``: the learner's ``save_state``.

Writes one JSON object to ``--out`` (default bench/results/learner_lora_smollm2.json). Wrap it in
``flock /tmp/asyncrl-heavy.lock`` on a shared machine.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
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


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def make_groups(vocab: int, groups: int, n: int, prompt: int, response: int, seed: int = 0):
    import numpy as np

    from asyncrl.wire.schema import Group, Sample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        ids = rng.integers(3, vocab, size=prompt).astype(np.int32)
        samples = [
            Sample(
                f"g{g}/{i}",
                rng.integers(3, vocab, size=response).astype(np.int32),
                (-np.log(vocab) + 0.1 * rng.standard_normal(response)).astype(np.float32),
                "",
                "stop",
                float(i % 2),
            )
            for i in range(n)
        ]
        out.append(Group(f"g{g}", f"p{g}", "t", "", "", ids, 0, "gen", samples))
    return out


def optimizer_state_bytes(engine) -> int:
    """Bytes of every tensor in the optimizer's state (moments), and of DeepSpeed's fp32 master
    partitions where it keeps them apart from the module."""
    import torch

    seen, total = set(), 0
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    for t in getattr(opt, "single_partition_of_fp32_groups", []):  # ZeRO 1-2's master partitions
        total += t.numel() * t.element_size()
    return total


def run_variant(args) -> dict:
    import torch

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import PolicyTrainer
    from asyncrl.models.fetch import resolve_model_path
    from asyncrl.models.lora import LoraConfig

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model_dir = resolve_model_path(args.model)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank) if args.variant == "lora" else None
    cfg = TrainerConfig(zero_stage=args.zero_stage, lr=args.lr, micro_batch_size=args.micro_batch_size)
    start = time.perf_counter()
    trainer = PolicyTrainer(model_dir, cfg, lora=lora)
    build_s = time.perf_counter() - start
    rss_build = _status_kib("VmRSS") * 1024
    groups = make_groups(trainer.hf_config.vocab_size, args.groups, args.n, args.prompt, args.response)
    trainer.train_step(groups)  # warm-up: AdamW's moments appear here
    rss_warm = _status_kib("VmRSS") * 1024
    step_s, peaks = [], []
    for _ in range(args.steps):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = _status_kib("VmRSS") * 1024
        t0 = time.perf_counter()
        trainer.train_step(groups)
        step_s.append(time.perf_counter() - t0)
        peaks.append(_status_kib("VmHWM") * 1024 - before)
    t0 = time.perf_counter()
    publish_bytes = 0
    for bucket in trainer.weight_buckets(64 << 20):
        for _, t in bucket:
            publish_bytes += t.detach().to("cpu", copy=True).numel() * t.element_size()
    publish_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trainer.save_state(tmp)
        checkpoint_s = time.perf_counter() - t0
        checkpoint_bytes = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
    module = trainer.engine.module
    return {
        "variant": args.variant,
        "lora": None if lora is None else lora.model_dump(),
        "build_s": build_s,
        "step_s": step_s,
        "step_s_median": statistics.median(step_s),
        "tokens_per_step": sum(g.num_tokens for g in groups),
        "rss_after_build_bytes": rss_build,
        "rss_after_warmup_bytes": rss_warm,
        "step_peak_bytes": max(peaks),
        "process_peak_bytes": _status_kib("VmHWM") * 1024,
        "params": sum(p.numel() for p in module.parameters()),
        "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "optimizer_state_bytes": optimizer_state_bytes(trainer.engine),
        "publish_bytes": publish_bytes,
        "publish_s": publish_s,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_s": checkpoint_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model folder or a known model's name")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank (alpha = 2 x rank)")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--variant", choices=["full", "lora"], help="run this variant here (the child's job)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learner_lora_smollm2.json"))
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args)))
        return 0
    results = {}
    for variant in ("full", "lora"):
        argv = [a for a in sys.argv[1:] if not a.startswith("--out")]
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--variant", variant], capture_output=True, text=True, timeout=1800
        )
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    summary = {
        "benchmark": "learner_lora",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python bench/learner_lora.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), CPU only",
        "model": args.model,
        "zero_stage": args.zero_stage,
        "dtype": "fp32",
        "variants": results,
        "lora_over_full": {
            "step_s_median": lora["step_s_median"] / full["step_s_median"],
            "rss_after_warmup_bytes": lora["rss_after_warmup_bytes"] / full["rss_after_warmup_bytes"],
            "step_peak_bytes": lora["step_peak_bytes"] / full["step_peak_bytes"],
            "optimizer_state_bytes": lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
            "trainable_params": lora["trainable_params"] / full["trainable_params"],
            "publish_bytes": lora["publish_bytes"] / full["publish_bytes"],
            "checkpoint_bytes": lora["checkpoint_bytes"] / full["checkpoint_bytes"],
        },
    }
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["lora_over_full"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
