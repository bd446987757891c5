"""Benchmark of the prioritized replay buffer: insert, sample and priority-update throughput.

    OMP_NUM_THREADS=1 .venv/bin/python bench/buffer.py            # prints one JSON object
    .venv/bin/python bench/buffer.py --quick                      # a smaller, faster run

Two parts, both through ``ReplayBuffer`` with a ``SlabStorage`` (one item = one trajectory):

1. *Index work* at each ``--capacity`` (10^6 and 10^5 items), against a baseline run beside it:
   the buffer full, each step inserts a batch (evicting the oldest), samples a batch (α = 0.6,
   β = 0.4, with replacement across steps: ``max_times_sampled=None``) and updates the sampled
   items' priorities. Payload-free, so it measures the sum tree, slots, keys and removers. The
   baseline is ``PlainSumTree``, a plain vectorised numpy sum tree doing the same step, timed in
   the same process, interleaved with the buffer over several repeats: absolute µs on a shared
   machine move by 1.7x from run to run, the ratio (``speedup``, plain / asyncrl) does not. Both
   are timed in this thread's CPU time (``time.thread_time``; everything runs on one thread), so
   that another process taking the core mid-measurement does not count against either side.
2. *Payload*: trajectories shaped like an LLM sample (256 prompt + 1,024 response int32 tokens,
   1,024 float32 logprobs: one 9,216-byte record), gathered into a preallocated batch, against a
   memcpy of the same byte count from the same slab, measured in the same run: the gather alone
   (``gather_vs_memcpy``, the payload goal) and the whole ``sample(out=)`` call with it. The slab
   holds ``--payload-items`` trajectories (2^17 = 1.2 GB: 10^6 would be 9.2 GB, more than this
   machine spares), far larger than any cache, which is what makes the comparison fair.

3. *Service*: groups per second through ``BufferService``'s sockets (insert frames in, batch
   frames out) against the in-process ``ReplayBuffer`` doing the same inserts and samples, in
   the same run (``service_vs_in_process``).

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

from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402
from asyncrl.buffer.config import BufferConfig  # noqa: E402
from asyncrl.buffer.replay import ReplayBuffer  # noqa: E402
from asyncrl.buffer.storage import SlabStorage  # noqa: E402

PROMPT, RESPONSE = 256, 1024
TRAJECTORY_FIELDS = {
    "prompt_ids": ((PROMPT,), np.int32),
    "response_ids": ((RESPONSE,), np.int32),
    "logprobs": ((RESPONSE,), np.float32),
}


KERNEL = "auto"  # BufferConfig.kernel of every buffer built here (--kernel)


def make_buffer(capacity: int, fields: dict, seed: int) -> ReplayBuffer:
    cfg = BufferConfig(
        kernel=KERNEL,
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


class PlainSumTree:
    """The baseline: a plain vectorised numpy proportional sum tree, the textbook PER buffer.

    What anyone would write from Schaul et al. (2016) with numpy and no further thought, kept
    here (not in the package) as the yardstick the buffer is measured against in the same run:

    - power-of-two leaves in an implicit heap (node 1 the root, node i's children 2i and 2i+1,
      leaf j at node L + j), one float64 sum tree and one float64 min tree;
    - insert: a ring buffer, the k newest overwrite the k oldest (FIFO), leaves p^α;
    - update: scattered leaf writes, then every level's parents recomputed from their children,
      one numpy call per level on the batch (sum and min);
    - sample: stratified, u_i = (i + U(0, 1)) · total / k, by a vectorised root-to-leaf descent
      (go right when u >= the left child's sum, and subtract it); P(i) = p_i^α / total and
      w_i = (P(i) / P_min)^-β = (p_i^α / min_j p_j^α)^-β.
    """

    def __init__(self, capacity: int, alpha: float, beta: float, seed: int):
        self.capacity, self.alpha, self.beta = capacity, alpha, beta
        self.leaves = 1 << max(0, (capacity - 1).bit_length())
        self.depth = self.leaves.bit_length() - 1
        self.sum = np.zeros(2 * self.leaves)  # (2L,)
        self.min = np.full(2 * self.leaves, np.inf)  # (2L,)
        self.next = 0  # ring-buffer write position
        self.size = 0
        self.rng = np.random.default_rng(seed)

    def _write(self, idx: np.ndarray, leaf: np.ndarray) -> None:
        pos = idx + self.leaves
        self.sum[pos] = leaf
        self.min[pos] = leaf
        for _ in range(self.depth):
            pos = pos >> 1
            left = 2 * pos
            self.sum[pos] = self.sum[left] + self.sum[left + 1]
            self.min[pos] = np.minimum(self.min[left], self.min[left + 1])

    def insert(self, priorities: np.ndarray) -> np.ndarray:
        idx = (self.next + np.arange(priorities.size)) % self.capacity
        self.next = (self.next + priorities.size) % self.capacity
        self.size = min(self.capacity, self.size + priorities.size)
        self._write(idx, priorities**self.alpha)
        return idx

    def sample(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(k,) indices, P(i), w_i."""
        total = self.sum[1]
        u = (np.arange(k) + self.rng.random(k)) * (total / k)
        pos = np.ones(k, dtype=np.int64)
        for _ in range(self.depth):
            pos <<= 1
            left = self.sum[pos]
            right = u >= left
            u -= left * right
            pos += right
        idx = np.minimum(pos - self.leaves, self.size - 1)
        leaf = self.sum[idx + self.leaves]
        return idx, leaf / total, (leaf / self.min[1]) ** -self.beta

    def update(self, idx: np.ndarray, priorities: np.ndarray) -> None:
        self._write(idx, priorities**self.alpha)


def time_us(fn, rounds: int, batch: int) -> float:
    """Mean µs per item of ``rounds`` calls of ``fn`` on ``batch`` items."""
    start = time.thread_time()
    for _ in range(rounds):
        fn()
    return (time.thread_time() - start) / (rounds * batch) * 1e6


def per_item_us(fn, rounds: int, batch: int) -> float:
    """Median over 5 repeats of the mean µs per item of ``rounds`` calls of ``fn`` on ``batch`` items."""
    fn()
    return float(np.median([time_us(fn, rounds, batch) for _ in range(5)]))


OPS = ("insert", "sample", "update", "step")


def bench_index(capacity: int, batch: int, rounds: int, repeats: int, seed: int) -> dict:
    """asyncrl's buffer against ``PlainSumTree``, both full, each op timed in turn, interleaved.

    Per repeat, each operation runs ``rounds`` times on the plain tree, then ``rounds`` times on
    the buffer; ``speedup`` is the median over repeats of plain µs / asyncrl µs (> 1: asyncrl is
    faster), so that both sides of each ratio saw the same load on the machine.
    """
    rng = np.random.default_rng(seed)
    buf = make_buffer(capacity, {}, seed)
    rows = np.zeros(batch, dtype=buf.storage.record)  # payload-free records
    fill(buf, batch, rows, rng)
    version = np.zeros(batch, dtype=np.int64)
    plain = PlainSumTree(capacity, 0.6, 0.4, seed)
    while plain.size < capacity:
        plain.insert(rng.random(batch))
    last = {"keys": buf.sample(batch).keys, "idx": plain.sample(batch)[0]}

    ours = {
        "insert": lambda: buf.insert_batch(rows, version, rng.random(batch)),
        "sample": lambda: last.__setitem__("keys", buf.sample(batch).keys),
        "update": lambda: buf.update_priorities(last["keys"], rng.random(batch)),
    }
    base = {
        "insert": lambda: plain.insert(rng.random(batch)),
        "sample": lambda: last.__setitem__("idx", plain.sample(batch)[0]),
        "update": lambda: plain.update(last["idx"], rng.random(batch)),
    }
    for side in (ours, base):
        ops = [side["insert"], side["sample"], side["update"]]
        side["step"] = lambda ops=ops: [op() for op in ops]
    times = {side: {op: [] for op in OPS} for side in ("asyncrl", "plain")}
    for fn in (*ours.values(), *base.values()):  # warm up
        fn()
    for _ in range(repeats):
        for op in OPS:
            times["plain"][op].append(time_us(base[op], rounds, batch))
            times["asyncrl"][op].append(time_us(ours[op], rounds, batch))
    out = {"capacity": capacity, "held_items": len(buf)}
    for op in OPS:
        a, p = np.array(times["asyncrl"][op]), np.array(times["plain"][op])
        out[op] = {
            "asyncrl_us_per_item": float(np.median(a)),
            "plain_us_per_item": float(np.median(p)),
            "speedup": float(np.median(p / a)),
            "speedup_min": float((p / a).min()),
        }
    out["step_items_per_s"] = 1e6 / out["step"]["asyncrl_us_per_item"]
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


def make_groups(count: int, tag: str, n: int = 8, length: int = 256) -> list:
    """``count`` scored groups of ``n`` samples with ``length``-token answers (unique ids)."""
    from asyncrl.wire.schema import Group, Sample

    rng = np.random.default_rng(0)
    return [
        Group(
            group_id=f"{tag}{g}",
            prompt_uid=f"bench/{g}",
            task="bench",
            prompt="",
            answer="",
            prompt_ids=np.arange(64, dtype=np.int32),
            policy_version=0,
            generator="bench",
            samples=[
                Sample(
                    uid=f"{tag}{g}/{i}",
                    response_ids=np.arange(length, dtype=np.int32),
                    logprobs=np.full(length, -0.5, dtype=np.float32),
                    text="",
                    finish_reason="stop",
                    reward=float(rng.random() < 0.5),
                )
                for i in range(n)
            ],
        )
        for g in range(count)
    ]


def bench_service(batch: int, batches: int, repeats: int) -> dict:
    """Groups per second through the buffer service's sockets against the in-process buffer.

    In-process: ``insert`` each group, then ``sample`` batches of ``batch`` groups (use once).
    Service: a ``BufferService`` serving in a thread on 127.0.0.1; a sender thread pushes the
    same groups as encoded frames (encoded beforehand: the producer's encoding is not the
    buffer's cost) and the main thread asks for batches of ``batch`` groups until every group
    came back; each reply is decoded, as a learner would. Both ends share one interpreter (the
    GIL), so the ratio is an upper bound on the service's overhead over the bare buffer.
    Repeats alternate the two; the ratio is the median of per-repeat ratios.
    """
    import threading

    from asyncrl import wire
    from asyncrl.buffer.service import BufferService
    from asyncrl.wire.messages import WantBatch
    from asyncrl.wire.sockets import Publisher, ReplyServer, RequestClient, StreamReceiver, StreamSender, tcp_address

    count = batch * batches
    cfg = BufferConfig(capacity_samples=8 * count, max_staleness=None, max_times_sampled=1, kernel=KERNEL)

    def in_process(groups) -> float:
        buf = ReplayBuffer.from_config(cfg)
        start = time.perf_counter()
        for at in range(0, count, batch):
            for g in groups[at : at + batch]:
                buf.insert(g)
            buf.sample(batch)
        return count / (time.perf_counter() - start)

    def through_sockets(groups) -> float:
        buf = ReplayBuffer.from_config(cfg)
        service = BufferService(
            buf,
            StreamReceiver(tcp_address(0), name="bench.buffer.in"),
            ReplyServer(tcp_address(0), name="bench.buffer.requests"),
            Publisher(tcp_address(0), name="bench.buffer.status"),
        )
        stop = threading.Event()
        thread = threading.Thread(target=service.serve, args=(stop.is_set,), daemon=True)
        producer = StreamSender(service.inbox.address, name="bench.producer")
        learner = RequestClient(service.requests.address, name="bench.learner")
        frames = [wire.encode_group(g) for g in groups]
        thread.start()
        try:
            start = time.perf_counter()
            sender = threading.Thread(target=lambda: [producer.send_frame(f, timeout=30) for f in frames])
            sender.start()
            received = 0
            while received < count:
                reply = learner.request(WantBatch(num_groups=batch, timeout_s=30.0), timeout=30.0)
                if reply is None:
                    raise RuntimeError(f"no batch within 30 s after {received} of {count} groups")
                received += len(reply[1].groups)
            elapsed = time.perf_counter() - start
            sender.join(30)
        finally:
            stop.set()
            thread.join(5)
            for sock in (producer, learner, service.inbox, service.requests, service.status):
                sock.close()
        return count / elapsed

    service_rate, local_rate = [], []
    for r in range(repeats):
        service_rate.append(through_sockets(make_groups(count, f"s{r}-")))
        local_rate.append(in_process(make_groups(count, f"l{r}-")))
    ratios = np.array(service_rate) / np.array(local_rate)
    return {
        "batch_groups": batch,
        "groups_per_repeat": count,
        "samples_per_group": 8,
        "response_tokens": 256,
        "service_groups_per_s": float(np.median(service_rate)),
        "in_process_groups_per_s": float(np.median(local_rate)),
        "service_vs_in_process": float(np.median(ratios)),
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


def _numba_version() -> str | None:
    try:
        import numba
    except ImportError:
        return None
    return numba.__version__


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=int, nargs="+", default=[1_000_000, 100_000])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=100, help="batches per timed repeat")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats (medians are reported)")
    parser.add_argument("--payload-items", type=int, default=1 << 17)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--service-batch", type=int, default=32, help="groups per batch through the service")
    parser.add_argument("--service-batches", type=int, default=20, help="batches per repeat through the service")
    parser.add_argument("--quick", action="store_true", help="capacity 10^5, 2^14 payload items, 30 rounds, 3 repeats")
    parser.add_argument("--no-torchrl", action="store_true", help="skip the TorchRL comparison")
    parser.add_argument("--kernel", choices=["auto", "numba", "numpy"], default="auto", help="buffer.kernel")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    global KERNEL
    KERNEL = args.kernel
    if args.quick:
        args.capacity, args.payload_items, args.rounds, args.repeats = [100_000], 1 << 14, 30, 3
    index = {str(c): bench_index(c, args.batch, args.rounds, args.repeats, args.seed) for c in args.capacity}
    payload = bench_payload(args.payload_items, args.batch, args.rounds, args.seed)
    service = bench_service(args.service_batch, args.service_batches, args.repeats)
    result = {
        "commit": measured_commit(),
        "config": {
            "capacity": args.capacity,
            "batch": args.batch,
            "alpha": 0.6,
            "beta": 0.4,
            "payload_items": args.payload_items,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "threads": 1,
            "numpy": np.__version__,
            "kernel": args.kernel,
            "tree": type(make_buffer(8, {}, 0).sampler.tree).__name__,
            "numba": _numba_version(),
        },
        "index": index,
        "payload": payload,
        "service": service,
        "goals": {
            **{f"step_ge_2x_plain_at_{c}": r["step"]["speedup"] >= 2.0 for c, r in index.items()},
            **{f"sample_ge_2x_plain_at_{c}": r["sample"]["speedup"] >= 2.0 for c, r in index.items()},
            "payload_ge_half_memcpy": payload["gather_vs_memcpy"] >= 0.5,
        },
    }
    if not args.no_torchrl:
        capacity = args.capacity[0]
        torchrl = bench_torchrl(capacity, args.batch, args.rounds, args.seed)
        result["torchrl"] = torchrl
        if torchrl.get("ran"):
            result["ours_vs_torchrl"] = (
                torchrl["step_us_per_item"] / index[str(capacity)]["step"]["asyncrl_us_per_item"]
            )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
