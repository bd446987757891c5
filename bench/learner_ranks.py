"""Benchmark of a learner group of 1 and 2 data-parallel ranks (``learner.ranks``) on the CPU.

    OMP_NUM_THREADS=1 .venv/bin/python bench/learner.py --ranks   # -> bench/results/learner_ranks.json

For each ZeRO stage (``--stages``, default 2 and 3) it starts a group of one rank, then a group
of two, as the launcher starts them (``asyncrl.fleet.launcher.learner_rank_env``, gloo), on the
same randomly initialised Qwen2 (built here; the character vocabulary, so that the transformer
blocks, not the embeddings, hold the parameters) and the same global batch: every rank calls
``PolicyTrainer.train_step`` with the whole batch and trains its share. After one warm-up step
(AdamW's moments are allocated on the first) each rank times ``--steps`` steps and reports:

- ``tokens_per_s``: the global batch's tokens (prompt + response) over the median step time;
- ``peak_rss_bytes``: the rank process's resident set high-water mark (``VmHWM``), loading the
  model included: each rank loads the whole fp32 model before DeepSpeed partitions it, so this
  peak does not halve with the ranks;
- ``held_bytes``: the bytes of the tensors the rank holds for parameters and optimizer state,
  each storage counted once: the module's parameters (under ZeRO-3 its partition, ``ds_tensor``),
  the ZeRO optimizer's fp32 master partitions and Adam's moments. With N ranks ZeRO-2 divides the
  master copy and the moments by N, ZeRO-3 the parameters too.

The claim checked (``pass``): at ZeRO-3 a rank of two holds at most 0.6 of what one rank holds.

On the CPU the two ranks share the machine's cores (``cpus``; the bench runs each with one
thread), with whatever else runs there (``load_average``): ``speedup`` is what two processes
gain on those cores, not what two devices would.

Weight publication (ZeRO-3, two ranks), ``--publish-repeats`` times each, median:

- ``rank0_publishes`` (what ``asyncrl.learner.weights_out`` does): every rank iterates
  ``trainer.weight_buckets`` (each bucket's gather is a collective), rank 0 packs every bucket
  into a send buffer (``asyncrl.weights.buckets.pack_into``), the others drop theirs;
- ``own_buckets``: the same gathers, each rank packs only its own buckets (every other one), as
  if each rank sent its share of the buckets;
- ``shard_read``: no gather, each rank copies its own ZeRO-3 partitions: the floor of a protocol
  in which the generators would assemble the shards of every rank themselves.
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

import numpy as np  # noqa: E402

from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402

CLAIM_RATIO = 0.6
"""A ZeRO-3 rank of two must hold at most this fraction of one rank's parameters + optimizer state."""

WORLD_TIMEOUT_S = 600
"""Seconds one group of ranks may take to build its trainer, step and publish."""

SHAPES = {
    # ``TinyModelConfig`` fields; "bench" is 24.4 M parameters, "tiny" (the test's) 0.1 M
    "bench": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    "tiny": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
}


def make_groups(args, vocab_size: int) -> list:
    """The global batch: ``args.groups`` groups of ``args.group_size`` answers, the same on every
    rank (seeded), ``args.prompt`` + ``args.response`` tokens each."""
    from asyncrl.wire.schema import Group, Sample

    rng = np.random.default_rng(0)
    groups = []
    for g in range(args.groups):
        samples = [
            Sample(
                f"g{g}/{i}",
                rng.integers(3, vocab_size, args.response).astype(np.int32),
                np.full(args.response, -np.log(vocab_size), np.float32),  # ~ the random model's sampler
                "",
                "stop",
                float(i % 2),
            )
            for i in range(args.group_size)
        ]
        prompt = rng.integers(3, vocab_size, args.prompt).astype(np.int32)
        groups.append(Group(f"g{g}", f"p{g}", "t", "", "", prompt, 0, "gen", samples))
    return groups


# -- one rank -----------------------------------------------------------------------------------


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def held_bytes(engine) -> dict[str, int]:
    """Bytes of the parameters, fp32 master copies and Adam moments this rank holds, each storage
    once (in that order: a master copy that is the parameters' own storage counts as parameters)."""
    import torch

    seen: set[int] = set()

    def total(tensors) -> int:
        count = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                count += storage.nbytes()
        return count

    params = total(getattr(p, "ds_tensor", p.data) for p in engine.module.parameters())
    optimizer = engine.optimizer
    masters = [
        t
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")  # ZeRO-1/2, ZeRO-3
        for t in getattr(optimizer, name, None) or []
    ]
    master = total(masters)
    inner = getattr(optimizer, "optimizer", optimizer)
    moments = total(v for state in inner.state.values() for v in state.values())
    return {"params": params, "master": master, "moments": moments, "total": params + master + moments}


def time_publication(trainer, bucket_bytes: int, repeats: int) -> dict:
    """Median seconds of each way to publish (see the module doc), measured on every rank, each
    run ended by a barrier so that it is the group's time."""
    import torch

    from asyncrl.weights.buckets import layout, pack_into

    rank, world = trainer.dp.rank, trainer.dp.world

    def gather_and_pack(mine) -> int:
        packed = 0
        for index, bucket in enumerate(trainer.weight_buckets(bucket_bytes)):
            if mine(index):
                specs, nbytes = layout(bucket)
                pack_into(bucket, specs, torch.empty(nbytes, dtype=torch.uint8), algo=None)
                packed += nbytes
        return packed

    def shard_read() -> int:
        parts = [getattr(p, "ds_tensor", p.data) for p in trainer.engine.module.parameters()]
        flat = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype)
        offset = 0
        for t in parts:
            flat[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return flat.numel() * flat.element_size()

    ways = {
        "rank0_publishes": lambda: gather_and_pack(lambda index: rank == 0),
        "own_buckets": lambda: gather_and_pack(lambda index: index % world == rank),
        "shard_read": shard_read,
    }
    out = {"bucket_bytes": bucket_bytes, "buckets": sum(1 for _ in trainer.weight_buckets(bucket_bytes))}
    for name, way in ways.items():
        seconds, packed = [], 0
        for _ in range(repeats):
            torch.distributed.barrier()
            start = time.perf_counter()
            packed = way()
            torch.distributed.barrier()
            seconds.append(time.perf_counter() - start)
        out[name] = {"seconds": statistics.median(seconds), "bytes_packed_by_this_rank": packed}
    return out


def rank_main(args) -> None:
    """One rank of a group (RANK/WORLD_SIZE/MASTER_* from the environment): train, measure, write
    ``rank{RANK}.json`` into ``args.out_dir``."""
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import PolicyTrainer

    rss_at_start = _status_bytes("VmRSS")  # torch, transformers and DeepSpeed imported, no model
    cfg = TrainerConfig(zero_stage=args.stage, lr=1e-5, micro_batch_size=args.groups * args.group_size)
    trainer = PolicyTrainer(args.model_dir, cfg)
    groups = make_groups(args, trainer.hf_config.vocab_size)
    for _ in range(args.warmup):
        trainer.train_step(groups)
    seconds = []
    for _ in range(args.steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        trainer.train_step(groups)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(g.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
    result = {
        "rank": trainer.dp.rank,
        "tokens": tokens,
        "step_seconds": [round(s, 4) for s in seconds],
        "tokens_per_s": tokens / statistics.median(seconds),
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "rss_at_start_bytes": rss_at_start,
        "held_bytes": held_bytes(trainer.engine),
    }
    if args.publish and args.stage == 3 and trainer.dp.world > 1:
        result["publication"] = time_publication(trainer, int(args.bucket_mb * (1 << 20)), args.publish_repeats)
    (args.out_dir / f"rank{trainer.dp.rank}.json").write_text(json.dumps(result))


# -- the parent ---------------------------------------------------------------------------------


def run_world(args, ranks: int, stage: int, out_dir: Path) -> list[dict]:
    """A group of ``ranks`` processes at ZeRO ``stage``; each rank's result, in rank order."""
    from asyncrl.fleet.launcher import learner_rank_env
    from asyncrl.wire.endpoints import free_ports

    out_dir.mkdir(parents=True)
    argv = [sys.executable, __file__, "--rank-of", str(args.model_dir), str(out_dir), "--stage", str(stage)]
    for key in ("groups", "group_size", "prompt", "response", "warmup", "steps", "bucket_mb", "publish_repeats"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if not args.publish:
        argv.append("--no-publish")
    procs = [
        subprocess.Popen(argv, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
        for env in learner_rank_env(ranks, free_ports(1)[0])
    ]
    try:
        codes = [p.wait(timeout=WORLD_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * ranks:
        raise RuntimeError(f"ZeRO-{stage} with {ranks} ranks failed: exit codes {codes}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(ranks)]


def summarise(stage: int, one: list[dict], two: list[dict]) -> dict:
    """One stage's figures: each group's throughput and per-rank memory, and two ranks against one."""

    def group(results: list[dict]) -> dict:
        return {
            "tokens_per_s": results[0]["tokens_per_s"],
            "step_seconds": results[0]["step_seconds"],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in results],
            "rss_at_start_bytes_per_rank": [r["rss_at_start_bytes"] for r in results],
            "held_bytes_per_rank": [r["held_bytes"] for r in results],
        }

    held_one = one[0]["held_bytes"]["total"]
    held_two = max(r["held_bytes"]["total"] for r in two)
    out = {
        "ranks_1": group(one),
        "ranks_2": group(two),
        "speedup": two[0]["tokens_per_s"] / one[0]["tokens_per_s"],
        "held_ratio": held_two / held_one,
        "peak_rss_ratio": max(r["peak_rss_bytes"] for r in two) / one[0]["peak_rss_bytes"],
    }
    if "publication" in two[0]:
        out["publication"] = publication_summary(two)
    return out


def publication_summary(two: list[dict]) -> dict:
    """The ways of publishing, timed on rank 0 (each run ends on a barrier: the group's time)."""
    pub = two[0]["publication"]
    ways = ("rank0_publishes", "own_buckets", "shard_read")
    gathered = min(("rank0_publishes", "own_buckets"), key=lambda w: pub[w]["seconds"])
    return {
        "bucket_bytes": pub["bucket_bytes"],
        "buckets": pub["buckets"],
        **{f"{w}_s": pub[w]["seconds"] for w in ways},
        "bytes_packed_per_rank": {w: [r["publication"][w]["bytes_packed_by_this_rank"] for r in two] for w in ways},
        "faster_of_rank0_and_own_buckets": gathered,
        "why_rank0": (
            "Under ZeRO-3 every bucket's gather is a collective that leaves the whole bucket on "
            "every rank, so splitting the sending between ranks saves only rank 0's copies, not "
            "the all-gathers; the code has rank 0 publish alone (the other ranks take part in the "
            "gathers) so that the generators keep one sender per version: one subscriber socket, "
            "one NCCL group with learner rank 0. Reading each rank's own shards without a gather "
            "(shard_read) is cheaper still, but the generators would then have to assemble the "
            "shards of every rank."
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(1, 2, 3))
    parser.add_argument("--groups", type=int, default=4, help="groups in the global batch (even: 2 ranks, 2 each)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--response", type=int, default=48, help="response tokens")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="publication bucket cap (weights.bucket_mb)")
    parser.add_argument("--publish-repeats", type=int, default=3)
    parser.add_argument("--no-publish", dest="publish", action="store_false")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learner_ranks.json")
    parser.add_argument("--rank-of", nargs=2, type=Path, metavar=("MODEL_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        args.model_dir, args.out_dir = args.rank_of
        rank_main(args)
        return
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    started = time.perf_counter()
    load_before = os.getloadavg()
    stages = {}
    with tempfile.TemporaryDirectory(prefix="bench_learner_ranks_") as tmp:
        shape = TinyModelConfig(**SHAPES[args.shape], max_position_embeddings=max(64, args.prompt + args.response))
        args.model_dir = build_tiny_model(shape, Path(tmp) / "model")
        params = count_parameters(args.model_dir)
        for stage in args.stages:
            one = run_world(args, 1, stage, Path(tmp) / f"z{stage}-1")
            two = run_world(args, 2, stage, Path(tmp) / f"z{stage}-2")
            stages[f"zero{stage}"] = summarise(stage, one, two)
    report = {
        "device": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "threads_per_rank": 1,
        "note": (
            "CPU, gloo: the ranks share the machine's cores (cpus) with each other and with whatever "
            "else runs (load_average); speedup is what a second process gains on them, not a second device's"
        ),
        "shape": args.shape,
        "parameters": params,
        "dtype": "fp32",
        "batch": {
            "groups": args.groups,
            "group_size": args.group_size,
            "prompt_tokens": args.prompt,
            "response_tokens": args.response,
        },
        "measured_steps": args.steps,
        "stages": stages,
    }
    if "zero3" in stages:
        report["claim"] = {
            "zero3_held_ratio": stages["zero3"]["held_ratio"],
            "bound": CLAIM_RATIO,
            "pass": stages["zero3"]["held_ratio"] <= CLAIM_RATIO,
        }
    report["load_average"] = {"before": load_before, "after": os.getloadavg()}
    report["wall_s"] = time.perf_counter() - started
    report["commit"] = measured_commit()
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


def count_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(int(np.prod(f.get_slice(key).get_shape())) for key in f.keys())


if __name__ == "__main__":
    main()
