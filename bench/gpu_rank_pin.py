"""On a GPU machine: the local launcher's plan pins each learner rank to a real device, and the
rank takes a training step there over NCCL (the learner alone: no vLLM needed).

    python3 bench/gpu_rank_pin.py [--ranks N] [--out F]      # bash bench/gpu_learner.sh ranks

Builds the run's GPU plan (``asyncrl.fleet.gpu_plan``) for ``learner.ranks: N`` with
``placement.learner.num_gpus: 1`` against this machine's devices, starts each rank as the
launcher does (the plan's ``CUDA_VISIBLE_DEVICES`` and the rank's DeepSpeed rendezvous in its
environment), and each rank builds a ``PolicyTrainer`` on a small Qwen2-shaped model (random
weights, built here), checks that it runs on CUDA with the NCCL backend on the device the plan
gave it, and trains two steps. Prints JSON: the plan's table, each rank's visible devices,
device, backend and step times; ``pass`` when every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rank_main(model_dir: str, out_file: str) -> int:
    """One rank, started with the plan's environment: a step on its device, the facts as JSON."""
    import numpy as np
    import torch

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import PolicyTrainer
    from asyncrl.wire.schema import Group, Sample

    trainer = PolicyTrainer(model_dir, TrainerConfig(zero_stage=2, dtype="bf16", micro_batch_size=8, lr=1e-5))
    rng = np.random.default_rng(0)
    vocab = trainer.hf_config.vocab_size
    groups = [
        Group(
            f"g{g}",
            f"p{g}",
            "t",
            "",
            "",
            rng.integers(3, vocab, 64).astype(np.int32),
            0,
            "gen",
            [
                Sample(
                    f"g{g}/{i}",
                    rng.integers(3, vocab, 128).astype(np.int32),
                    np.full(128, -5.0, np.float32),
                    "",
                    "stop",
                    float(i % 2),
                )
                for i in range(4)
            ],
        )
        for g in range(4 * trainer.dp.world)
    ]
    times = []
    for _ in range(2):
        start = time.perf_counter()
        stats = trainer.train_step(groups)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    facts = {
        "rank": trainer.dp.rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "device": str(trainer.device),
        "device_name": torch.cuda.get_device_name(trainer.device),
        "backend": torch.distributed.get_backend(),
        "step_s": times,
        "loss": stats.loss,
        "tokens": stats.tokens,
    }
    Path(out_file).write_text(json.dumps(facts))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--ranks", type=int, default=None, help="learner ranks (default: this machine's GPUs, at most 2)"
    )
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rank-child", nargs=2, metavar=("MODEL_DIR", "OUT_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_child:
        return rank_main(*args.rank_child)

    import torch

    from asyncrl.config import load_config
    from asyncrl.fleet.gpu_plan import gpu_plan
    from asyncrl.fleet.launcher import learner_process_names, learner_rank_env
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
    from asyncrl.wire.endpoints import free_ports

    ranks = args.ranks or max(1, min(2, torch.cuda.device_count()))
    cfg = load_config(ROOT / "configs/demo.yaml", [f"learner.ranks={ranks}", "placement.learner.num_gpus=1"])
    plan = gpu_plan(cfg)
    if plan is None:
        raise SystemExit("the plan gave no process a GPU: is CUDA visible here?")
    work = Path(tempfile.mkdtemp(prefix="rank_pin_"))
    model = build_tiny_model(TinyModelConfig(hidden_size=512, num_layers=4, intermediate_size=1408), work / "model")
    procs, outs = [], []
    for name, rank_env in zip(learner_process_names(ranks), learner_rank_env(ranks, free_ports(1)[0])):
        out = work / f"{name}.json"
        env = {**os.environ, **plan.env(name), **rank_env}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-child", str(model), str(out)]
        procs.append(subprocess.Popen(cmd, env=env))
        outs.append((name, out))
    codes = [p.wait(timeout=600) for p in procs]
    facts = {name: json.loads(out.read_text()) if out.exists() else None for name, out in outs}
    checks = {
        name: f is not None
        and f["backend"] == "nccl"
        and f["device"].startswith("cuda")
        and f["cuda_visible_devices"] == plan.env(name).get("CUDA_VISIBLE_DEVICES")
        for name, f in facts.items()
    }
    result = {
        "plan": plan.table(),
        "ranks": facts,
        "exit_codes": codes,
        "pass": all(checks.values()) and not any(codes),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
