"""Benchmark of the prioritized replay buffer: insert, sample and priority-update throughput.

    OMP_NUM_THREADS=1 .venv/bin/python bench/buffer.py            # prints one JSON object
    .venv/bin/python bench/buffer.py --quick                      # a smaller, faster run

Two parts, both through ``ReplayBuffer`` with a ``SlabStorage`` (one item = one trajectory):

1. *Index work* at ``--capacity`` items (10^6): the buffer full, each step inserts a batch
   (evicting the oldest), samples a batch (α = 0.6, β = 0.4, with replacement across steps:
   ``max_times_sampled=None``) and updates the sampled items' priorities. Payload-free, so it
   measures the sum tree, slots, keys and removers: µs per item for each operation and the step.
2. *Payload*: trajectories shaped like an LLM sample (256 prompt + 1,024 response int32 tokens,
   1,024 float32 logprobs: one 9,216-byte record), gathered into a preallocated batch, against a
   memcpy of the same byte count from the same slab, measured in the same run: the gather alone
   (``gather_vs_memcpy``, the payload goal) and the whole ``sample(out=)`` call with it. The slab
   holds ``--payload-items`` trajectories (2^17 = 1.2 GB: 10^6 would be 9.2 GB, more than this
   machine spares), far larger than any cache, which is what makes the comparison fair.

If ``torchrl`` imports and its prioritized sampler works with the installed torch, the same
index-work step runs through ``torchrl.data.PrioritizedReplayBuffer`` and the ratio is printed;
otherwise the JSON says why not. Math libraries are single-threaded (set before numpy loads).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.buffer.config import BufferConfig  # noqa: E402
from asyncrl.buffer.replay import ReplayBuffer  # noqa: E402
from asyncrl.buffer.storage import SlabStorage  # noqa: E402

PROMPT, RESPONSE = 256, 1024
TRAJECTORY_FIELDS = {
    "prompt_ids": ((PROMPT,), np.int32),
    "response_ids": ((RESPONSE,), np.int32),
    "logprobs": ((RESPONSE,), np.float32),
}


def make_buffer(capacity: int, fields: dict, seed: int) -> ReplayBuffer:
    cfg = BufferConfig(
        capacity_samples=capacity,
        sampler="prioritized",
        alpha=0.6,
        beta=0.4,
        beta_final=0.4,
        max_times_sampled=None,
        max_staleness=None,
        seed=seed,
    )
    return ReplayBuffer.from_config(cfg, storage=SlabStorage(capacity, fields))


def fill(buf: ReplayBuffer, batch: int, rows, rng: np.random.Generator) -> None:
    version = np.zeros(batch, dtype=np.int64)
    while len(buf) < buf.storage.max_items:
        k = min(batch, buf.storage.max_items - len(buf))
        buf.insert_batch(rows[:k], version[:k], rng.random(k))


def per_item_us(fn, rounds: int, batch: int) -> float:
    """Median over 5 repeats of the mean µs per item of ``rounds`` calls of ``fn`` on ``batch`` items."""
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        times.append((time.perf_counter() - start) / (rounds * batch) * 1e6)
    return float(np.median(times))


def bench_index(capacity: int, batch: int, rounds: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    buf = make_buffer(capacity, {}, seed)
    rows = np.zeros(batch, dtype=buf.storage.record)  # payload-free records
    fill(buf, batch, rows, rng)
    version = np.zeros(batch, dtype=np.int64)
    last = {"keys": buf.sample(batch).keys}

    def insert():
        buf.insert_batch(rows, version, rng.random(batch))

    def sample():
        last["keys"] = buf.sample(batch).keys

    def update():
        buf.update_priorities(last["keys"], rng.random(batch))

    def step():
        insert()
        sample()
        update()

    out = {
        name: per_item_us(fn, rounds, batch)
        for name, fn in (
            ("insert_us_per_item", insert),
            ("sample_us_per_item", sample),
            ("update_us_per_item", update),
            ("step_us_per_item", step),
        )
    }
    out["step_items_per_s"] = 1e6 / out["step_us_per_item"]
    out["held_items"] = len(buf)
    return out


def bench_payload(items: int, batch: int, rounds: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    buf = make_buffer(items, TRAJECTORY_FIELDS, seed)
    storage = buf.storage
    rows = np.zeros(batch, dtype=storage.record)
    for name in storage.record.names:
        rows[name] = rng.integers(0, 32000, size=rows[name].shape)
    fill(buf, batch, rows, rng)
    out = np.empty(batch, dtype=storage.record)  # the batch the learner would get
    keys = {"k": buf.sample(batch, out=out).keys}

    def gather():  # the payload move alone: random records into the batch
        storage.gather(rng.integers(0, items, batch), out)

    def memcpy():  # the same bytes, contiguous, from a random place in the same slab
        start = int(rng.integers(0, items - batch))
        np.copyto(out, storage.slab[start : start + batch])

    def sample():  # the whole sample call: tree descent, bookkeeping and the gather
        keys["k"] = buf.sample(batch, out=out).keys

    def step():
        buf.insert_batch(rows, np.zeros(batch, dtype=np.int64), rng.random(batch))
        sample()
        buf.update_priorities(keys["k"], rng.random(batch))

    gather_us = per_item_us(gather, rounds, batch)
    memcpy_us = per_item_us(memcpy, rounds, batch)
    sample_us = per_item_us(sample, rounds, batch)
    step_us = per_item_us(step, rounds, batch)
    item_bytes = storage.row_bytes
    return {
        "items": items,
        "item_bytes": item_bytes,
        "gather_us_per_item": gather_us,
        "gather_GBps": item_bytes / gather_us / 1e3,
        "memcpy_us_per_item": memcpy_us,
        "memcpy_GBps": item_bytes / memcpy_us / 1e3,
        "gather_vs_memcpy": memcpy_us / gather_us,
        "sample_with_payload_us_per_item": sample_us,
        "sample_with_payload_vs_memcpy": memcpy_us / sample_us,
        "step_with_payload_us_per_item": step_us,
    }


def bench_torchrl(capacity: int, batch: int, rounds: int, seed: int) -> dict:
    """The same index-work step through TorchRL's prioritized buffer, or why it cannot run."""
    try:
        import torch
        import torchrl  # noqa: F401
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer
    except Exception as e:  # any import failure is the answer: report it
        return {"ran": False, "why_not": f"import torchrl failed: {type(e).__name__}: {e}"}
    try:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        rb = PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(capacity), batch_size=batch)
        data = torch.arange(batch)
        for _ in range(capacity // batch):
            rb.extend(data)
        last = {}

        def step():
            rb.extend(data)
            _, info = rb.sample(return_info=True)
            last["i"] = info["index"]
            rb.update_priority(info["index"], torch.rand(batch))

        us = per_item_us(step, max(1, rounds // 4), batch)
        return {"ran": True, "version": torchrl.__version__, "step_us_per_item": us, "step_items_per_s": 1e6 / us}
    except Exception as e:
        detail = f"{type(e).__name__}: {e}"
        try:  # TorchRL swallows the reason its C++ sum tree is missing; ask for it directly
            import torchrl._torchrl  # noqa: F401
        except ImportError as cause:
            detail += f" The C++ extension torchrl._torchrl does not load: {str(cause)[:200]}"
        return {"ran": False, "version": torchrl.__version__, "torch": torch.__version__, "why_not": detail}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=200, help="batches per timed repeat (5 repeats, median)")
    parser.add_argument("--payload-items", type=int, default=1 << 17)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="capacity 10^5, 2^14 payload items, 50 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.capacity, args.payload_items, args.rounds = 100_000, 1 << 14, 50
    index = bench_index(args.capacity, args.batch, args.rounds, args.seed)
    payload = bench_payload(args.payload_items, args.batch, args.rounds, args.seed)
    torchrl = bench_torchrl(args.capacity, args.batch, args.rounds, args.seed)
    result = {
        "config": {
            "capacity": args.capacity,
            "batch": args.batch,
            "alpha": 0.6,
            "beta": 0.4,
            "payload_items": args.payload_items,
            "rounds": args.rounds,
            "threads": 1,
        },
        "index": index,
        "payload": payload,
        "torchrl": torchrl,
        "goals": {
            "step_le_2us_per_item": index["step_us_per_item"] <= 2.0,
            "sample_le_0.75us_per_item": index["sample_us_per_item"] <= 0.75,
            "payload_ge_half_memcpy": payload["gather_vs_memcpy"] >= 0.5,
        },
    }
    if torchrl.get("ran"):
        result["ours_vs_torchrl"] = torchrl["step_us_per_item"] / index["step_us_per_item"]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
