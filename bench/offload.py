"""What offload costs a learner step: the same model, batch and ZeRO stage with the optimizer state
(and parameters) kept in place, in host memory, or swapped to NVMe files
(``learner.trainer.offload``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/offload.py [--hidden 512 --layers 8 --steps 3]

Each variant runs in a fresh child process (one rank, fp32): a warm-up step (AdamW's moments are
allocated on the first), then ``--steps`` timed ``PolicyTrainer.train_step`` calls on one batch of
16 sequences; it reports the median step time and the process's peak resident set (``VmHWM``).
On a CPU-only machine "offloaded" state is host memory either way: the figures are the cost of
DeepSpeed's offload bookkeeping (the copies of gradients and weights, the partitioned update,
NVMe's file traffic), not the saving in accelerator memory. One JSON object on stdout.
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

VARIANTS = {
    "zero2": (2, {}),
    "zero2_optimizer_cpu": (2, {"optimizer": "cpu"}),
    "zero2_optimizer_cpu_deepspeed_adam": (2, {"optimizer": "cpu", "optimizer_impl": "deepspeed_cpu_adam"}),
    "zero3": (3, {}),
    "zero3_optimizer_cpu": (3, {"optimizer": "cpu"}),
    "zero3_optimizer_params_cpu": (3, {"optimizer": "cpu", "params": "cpu"}),
    "zero3_optimizer_params_nvme": (3, {"optimizer": "nvme", "params": "nvme"}),
    "zero3_optimizer_nvme_subgroups_1e8": (3, {"optimizer": "nvme", "sub_group_elements": 100_000_000}),
}


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_variant(name: str, model_dir: str, steps: int, swap_dir: str) -> dict:
    """One variant in this process (the child)."""
    from asyncrl.learner.trainer import PolicyTrainer, TrainerConfig
    from tests.learner.trainer.steps import make_groups

    stage, offload = VARIANTS[name]
    if "nvme" in offload.values():
        offload = {**offload, "nvme_path": swap_dir}
    cfg = TrainerConfig(zero_stage=stage, lr=1e-4, micro_batch_size=16, offload=offload)
    trainer = PolicyTrainer(model_dir, cfg)
    groups = make_groups(trainer.hf_config.vocab_size)
    trainer.train_step(groups)  # warm-up: the optimizer's state is allocated here
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(groups)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "steps_s": times, "peak_rss_bytes": peak_rss_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--swap-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args.model_dir, args.steps, args.swap_dir)))
        return

    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        shape = TinyModelConfig(
            hidden_size=args.hidden, num_layers=args.layers, num_heads=8, intermediate_size=4 * args.hidden
        )
        model_dir = build_tiny_model(shape, Path(tmp) / "model")
        import torch
        from transformers import AutoModelForCausalLM

        params = sum(
            p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).parameters()
        )
        out = {"model": shape.model_dump(), "parameters": params, "variants": {}}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        for name in args.variants:
            cmd = [sys.executable, __file__, "--child", name, "--model-dir", str(model_dir), "--steps", str(args.steps)]
            cmd += ["--swap-dir", str(Path(tmp) / "nvme")]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                out["variants"][name] = {"error": done.stderr.strip().splitlines()[-1:]}
                continue
            out["variants"][name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
