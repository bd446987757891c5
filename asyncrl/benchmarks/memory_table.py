"""Which learner configurations of 7 B and 32 B fit 8 GPUs of 80 and 141 GB, by the memory model.

For each model, GPU, node count and configuration (ZeRO stage, offload, gradient checkpointing,
sequence parallelism) the table gives the device and host peak of one rank at one row of 4,096
tokens, the largest sequence length one row may have (micro batch 1), the largest micro batch of
4,096-token rows, and what dominates the device peak there. A configuration fits when the
predicted device peak is at most ``USABLE_FRACTION`` of the GPU's memory as torch reports it
(the rest: the CUDA context, NCCL's buffers, the caching allocator's fragmentation) and a node's
8 ranks' host peaks fit ``HOST_BYTES_PER_NODE``.

These are predictions, not measurements: the model is checked against measured peaks on the CPU
only (``bench/results/memory_measured.json``). Two things on main change the answer and are
columns of their own: every rank loads the whole model in fp32 on the host and moves it whole to
its device before ZeRO-3 partitions it (``partitioned_load`` = False), and ZeRO-1/2 keep an fp32
master even of fp32 weights (irrelevant in bf16, which the table uses).
"""

from __future__ import annotations

from dataclasses import asdict, replace

from asyncrl.benchmarks.memory_model import GiB, LearnerSetup, predict
from asyncrl.benchmarks.model_shapes import SHAPES, ModelShape

GPUS = {"H100-80GB": 79.2 * GiB, "H200-141GB": 139.8 * GiB}
"""Memory as ``torch.cuda.get_device_properties().total_memory`` reports it (80 GB and 141 GB
parts: 85.0e9 and 150.1e9 bytes)."""
USABLE_FRACTION = 0.9
HOST_BYTES_PER_NODE = 2 * 1024 * GiB
"""A DGX H100/H200 node's 2 TB of host memory."""
GPUS_PER_NODE = 8
ROW_TOKENS = 4096
MAX_SEQ = 1 << 20

CONFIGS = [
    # (label, overrides of LearnerSetup)
    ("ZeRO-1", dict(zero_stage=1)),
    ("ZeRO-2", dict(zero_stage=2)),
    ("ZeRO-2 + optimizer on cpu", dict(zero_stage=2, optimizer_offload="cpu")),
    ("ZeRO-3", dict(zero_stage=3)),
    ("ZeRO-3 + optimizer on cpu", dict(zero_stage=3, optimizer_offload="cpu")),
    ("ZeRO-3 + optimizer and parameters on cpu", dict(zero_stage=3, optimizer_offload="cpu", param_offload="cpu")),
    ("ZeRO-3 + optimizer and parameters on nvme", dict(zero_stage=3, optimizer_offload="nvme", param_offload="nvme")),
]


def fits(shape: ModelShape, setup: LearnerSetup, device_bytes: float) -> bool:
    est = predict(shape, setup)
    return (
        est.device_peak <= USABLE_FRACTION * device_bytes
        and GPUS_PER_NODE * est.host_peak <= USABLE_FRACTION * HOST_BYTES_PER_NODE
    )


def largest(fit, lo: int, hi: int) -> int:
    """The largest x in [lo, hi] with fit(x), fit monotone decreasing; 0 when fit(lo) is False."""
    if not fit(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fit(mid) else (lo, mid - 1)
    return lo


def row(shape: ModelShape, setup: LearnerSetup, device_bytes: float) -> dict:
    """One configuration's figures (module docstring)."""
    at_row = predict(shape, setup)
    max_seq = largest(lambda s: fits(shape, replace(setup, seq_len=s, micro_batch=1), device_bytes), 256, MAX_SEQ)
    max_micro = largest(lambda m: fits(shape, replace(setup, micro_batch=m), device_bytes), 1, 4096)
    at_max = predict(shape, replace(setup, seq_len=max(max_seq, 256), micro_batch=1))
    return {
        "device_peak_gib_at_4096": round(at_row.device_peak / GiB, 1),
        "host_peak_gib_per_rank": round(at_row.host_peak / GiB, 1),
        "load_device_gib": round(at_row.load_device / GiB, 1),
        "fits_at_4096": fits(shape, setup, device_bytes),
        "max_seq_len_micro_batch_1": max_seq,
        "max_micro_batch_at_4096": max_micro,
        "dominant_at_4096": at_row.dominant(),
        "dominant_at_max_seq": at_max.dominant() if max_seq else None,
    }


def table() -> dict:
    """The whole table: 7 B on one node, 32 B on 1, 2 and 4 nodes, each GPU, each configuration,
    with and without gradient checkpointing, sequence parallelism 1 and 8; loading partitioned
    (``zero.Init``), and whether it still fits loading whole (main)."""
    cases = [("qwen2.5-7b", 1), ("qwen2.5-32b", 1), ("qwen2.5-32b", 2), ("qwen2.5-32b", 4)]
    rows = []
    for name, nodes in cases:
        shape = SHAPES[name]
        for gpu, device_bytes in GPUS.items():
            for label, overrides in CONFIGS:
                for checkpointing in (False, True):
                    for sp in (1, 8):
                        setup = LearnerSetup(
                            ranks=GPUS_PER_NODE * nodes,
                            dtype="bf16",
                            seq_len=ROW_TOKENS,
                            attention="flash",
                            gradient_checkpointing=checkpointing,
                            sequence_parallel=sp,
                            partitioned_load=True,
                            micro_batches=2,
                            **overrides,
                        )
                        whole = replace(setup, partitioned_load=False)
                        rows.append(
                            {
                                "model": name,
                                "parameters": shape.parameters(),
                                "gpu": gpu,
                                "nodes": nodes,
                                "config": label,
                                "gradient_checkpointing": checkpointing,
                                "sequence_parallel": sp,
                                **row(shape, setup, device_bytes),
                                "fits_at_4096_whole_load": fits(shape, whole, device_bytes),
                                "load_device_gib_whole_load": round(predict(shape, whole).load_device / GiB, 1),
                                "load_host_gib_per_node_whole_load": round(
                                    GPUS_PER_NODE * predict(shape, whole).load_host / GiB
                                ),
                            }
                        )
    return {
        "note": (
            "Predicted by asyncrl.benchmarks.memory_model (checked against CPU measurements only); "
            f"bf16, flash-attention, logits chunk 512, DeepSpeed's default buckets, gradients accumulated over micro batches; fits: device peak "
            f"<= {USABLE_FRACTION} of the GPU's memory and 8 ranks' host peaks <= {USABLE_FRACTION} "
            f"of {HOST_BYTES_PER_NODE / GiB:.0f} GiB per node"
        ),
        "defaults": asdict(LearnerSetup(dtype="bf16", attention="flash")),
        "gpus_gib": {k: round(v / GiB, 1) for k, v in GPUS.items()},
        "rows": rows,
    }


def markdown(report: dict, checkpointing: tuple[bool, ...] = (False, True), sp: tuple[int, ...] = (1, 8)) -> str:
    """The table's rows (with partitioned loading; whole loading in its own column) as markdown."""
    lines = [
        "| model | GPU | nodes | config | ckpt | SP | fits at 4K (whole load) | peak at 4K GiB | longest row | micro batch at 4K | dominates (4K / longest) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    yes = {True: "yes", False: "no"}
    for r in report["rows"]:
        if r["gradient_checkpointing"] not in checkpointing or r["sequence_parallel"] not in sp:
            continue
        lines.append(
            f"| {r['model']} | {r['gpu']} | {r['nodes']} | {r['config']} | {yes[r['gradient_checkpointing']]} "
            f"| {r['sequence_parallel']} | {yes[r['fits_at_4096']]} ({yes[r['fits_at_4096_whole_load']]}) "
            f"| {r['device_peak_gib_at_4096']} "
            f"| {r['max_seq_len_micro_batch_1']:,} | {r['max_micro_batch_at_4096']} "
            f"| {r['dominant_at_4096']} / {r['dominant_at_max_seq'] or '-'} |"
        )
    return "\n".join(lines)


def pivot(report: dict, checkpointing: bool, sp: int) -> str:
    """One markdown table per (checkpointing, sequence parallel): configurations down, model x
    nodes x GPU across; a cell is the longest row in tokens (micro batch 1) and the largest micro
    batch of 4,096-token rows, "no" where a 4,096-token row does not fit, † where it fits only when
    loaded partitioned (main loads whole)."""
    rows = [r for r in report["rows"] if r["gradient_checkpointing"] == checkpointing and r["sequence_parallel"] == sp]
    columns = list(dict.fromkeys((r["model"], r["nodes"], r["gpu"]) for r in rows))
    head = [
        f"{m.removeprefix('qwen2.5-').upper()} × {n} node{'s' if n > 1 else ''}, {g.split('-')[0]}"
        for m, n, g in columns
    ]
    lines = ["| config | " + " | ".join(head) + " |", "| --- |" + " --- |" * len(columns)]
    for label, _ in CONFIGS:
        cells = []
        for column in columns:
            (r,) = [x for x in rows if (x["model"], x["nodes"], x["gpu"]) == column and x["config"] == label]
            if not r["fits_at_4096"]:
                cells.append("no")
                continue
            longest = r["max_seq_len_micro_batch_1"]
            text = "≥1M" if longest >= MAX_SEQ else f"{longest // 1000}K"
            cells.append(f"{text} · {r['max_micro_batch_at_4096']}" + ("" if r["fits_at_4096_whole_load"] else " †"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
