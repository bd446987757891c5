"""Benchmark of weight broadcast: shared memory and ZeroMQ streaming against memcpy and raw ZeroMQ.

    OMP_NUM_THREADS=1 .venv/bin/python bench/weights.py                   # 100/500/1000 MB x 1/2/4 subscribers
    .venv/bin/python bench/weights.py --sizes 50 --subscribers 1 2        # a smaller run

For each size, a Qwen2-shaped state dict of random fp32 tensors (an embedding, then decoder
layers of q/k/v/o, gate/up/down and norms, hidden 1024, intermediate 2816) is published in
``--bucket-mb`` buckets to 1, 2 and 4 local subscriber *processes*, and timed from the start of
``publish`` until the last subscriber holds verified tensors (every bucket's checksum checked: sum64 for shm, fletcher64 for zmq):
``shm_s``, ``zmq_s``. For shared memory, ``shm_delivery_s`` stops earlier, when the last
subscriber has the announcement: from then on the tensors are there to map, and what follows
(mapping, every subscriber reading every byte for its checksum) is per-subscriber work.
In the same run, the baselines on the same bytes:

- ``memcpy``: copying every tensor into a preallocated, already-touched buffer; ``memcpy_cold``
  copies into fresh memory (page faults included). The goal is read against the warm figure:
  from the third publication on the publisher writes into the files of a version every
  subscriber is done with, pages and mappings already there, as in a run's steady state.
- ``raw_zmq``: a bare PUB -> SUB send of the same bytes in frames of the same size as the
  stream's (``--frame-mb``, by default the stream's own, ``weights.frame_mb``: a tensor is cut
  into frames of at most that size in both; larger frames flatter the ratio by slowing raw
  ZeroMQ more than the stream, as every fresh 64 MiB message faults its pages in),
  ``copy=False``, to the same number of subscribers, which only receive (no checksum, no
  tensors). The SUB sockets have the same options (unlimited RCVHWM, the stream's MAXMSGSIZE);
  the raw PUB queues without limit (it does not wait for a bucket to leave before the next).

Ratios: ``shm_vs_memcpy = memcpy_s / shm_s`` and ``shm_delivery_vs_memcpy`` (goal >= 0.5 and
flat from 1 to 4 subscribers: ``*_time_most_over_fewest_subscribers``), ``zmq_vs_raw =
raw_zmq_s / zmq_s`` (goal >= 0.7): the best time of each over the repeats; and per round (the
two sent one after the other, the same bytes, taking turns going first), ``zmq_vs_raw_rounds``,
and over the rounds after the first (where both receive into fresh memory) their median
``zmq_vs_raw_median`` and ``zmq_vs_raw_spread`` [min, max]. Learner memory: the peak growth of the publishing process's
anonymous RSS during ``publish`` (sampled every 2 ms; for zmq until the last subscriber's report,
and the same sampler runs over the same span while raw ZeroMQ is sent: both carry its CPU), in
buckets, and for zmq the peak bytes of
packing buffers the publisher holds (``learner_buffer_buckets_zmq``: 0 when it sends views of
the tensors themselves); goal <= 2. ``publisher_cpu_s_*``: CPU seconds of the publishing process
(all threads) for memcpy and each publication, a view that other jobs on the cores hardly move;
``subscriber_cpu_s_zmq`` / ``_raw_zmq``: the same for one subscriber process, per version, and
``zmq_vs_raw_cpu``: all processes' CPU seconds for raw over those for zmq, the most
``zmq_vs_raw`` can reach where both are CPU-bound. For shm the version itself lives in
/dev/shm, reported apart as ``shm_bytes``. ``load_average`` says how busy the machine was.
One JSON object on stdout.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import zmq  # noqa: E402

from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402
from asyncrl.weights.buckets import state_dict_buckets  # noqa: E402
from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber  # noqa: E402
from asyncrl.weights.stream import FRAME_BYTES, MESSAGE_BYTES, ZmqWeightPublisher, ZmqWeightSubscriber  # noqa: E402
from asyncrl.wire import security  # noqa: E402

MB = 1_000_000
MiB = 1 << 20


def qwen2_like(total_bytes: int, hidden: int = 1024, inter: int = 2816, vocab: int = 32000, kv: int = 256) -> dict:
    """Random fp32 tensors with Qwen2 names and shapes, about ``total_bytes`` in all."""
    g = torch.Generator().manual_seed(0)
    sd, size = {}, 0

    def add(name, *shape):
        nonlocal size
        t = torch.empty(*shape)
        t.uniform_(-0.05, 0.05, generator=g)
        sd[name] = t
        size += t.numel() * 4

    if vocab * hidden * 4 < total_bytes / 4:
        add("model.embed_tokens.weight", vocab, hidden)
    layer = 0
    while size < total_bytes:
        p = f"model.layers.{layer}."
        for name, shape in (
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.weight", (kv, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (inter, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("mlp.down_proj.weight", (hidden, inter)),
            ("input_layernorm.weight", (hidden,)),
        ):
            if size >= total_bytes:
                break
            add(p + name, *shape)
        layer += 1
    return sd


def _anon_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Peak anonymous RSS growth of this process while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.base = self.peak = _anon_rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _anon_rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _anon_rss())
        self.extra = self.peak - self.base


def subscriber(shm_addr: str, zmq_addr: str, raw_addr: str, results, ready) -> None:
    """One subscriber process: receives from every publisher, reports when a version is whole.

    One thread per transport, each blocked in its own wait (no polling loop: with four
    subscriber processes on two cores, waking every millisecond would tax the cases measured)."""
    shm = ShmWeightSubscriber(shm_addr, name="bench.shm")
    stream = ZmqWeightSubscriber(zmq_addr, name="bench.zmq", timeout_s=120)
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.RCVHWM, 0)  # as the stream's subscriber
    raw.setsockopt(zmq.MAXMSGSIZE, security.max_message_bytes("subscribe"))
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(raw_addr)
    stop = threading.Event()
    pid = os.getpid()

    def report_shm(u):
        # Delivered when announced whole (the tensors are there to map from then on); verified
        # when every bucket's checksum has been checked.
        results.put(("shm_delivery", u.version, u.announced_at, u.nbytes, pid, time.process_time()))
        results.put(("shm", u.version, u.announced_at + u.receive_s, u.nbytes, pid, time.process_time()))

    def report_zmq(u):
        results.put(("zmq", u.version, time.monotonic(), u.nbytes, pid, time.process_time()))

    def take(sub, report):
        served = 0
        while not stop.is_set():
            u = sub.newest(served, timeout=0.2)
            if u is not None:
                served = u.version
                report(u)
                u.done()

    threads = [
        threading.Thread(target=take, args=args, daemon=True) for args in ((shm, report_shm), (stream, report_zmq))
    ]
    for t in threads:
        t.start()
    ready.set()
    while True:
        parts = raw.recv_multipart(copy=False)
        if len(parts) == 1 and parts[0].bytes == b"stop":
            break
        if len(parts) == 1 and parts[0].bytes.startswith(b"end"):
            results.put(("raw", int(parts[0].bytes[3:]), time.monotonic(), 0, pid, time.process_time()))
    stop.set()
    for t in threads:
        t.join(5)


def memcpy_seconds(sd: dict) -> tuple[float, float, float]:
    """Warm and cold memcpy of every tensor (wall seconds), and the warm one's CPU seconds."""
    flat = [t.reshape(-1) for t in sd.values()]
    total = sum(t.numel() for t in flat)
    dst = torch.empty(total)
    dst.zero_()  # touched: no page faults in the timed copy
    best = best_cpu = float("inf")
    for _ in range(2):
        start, cpu, off = time.perf_counter(), time.process_time(), 0
        for t in flat:
            dst[off : off + t.numel()].copy_(t)
            off += t.numel()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    del dst
    start, off = time.perf_counter(), 0
    cold = torch.empty(total)
    for t in flat:
        cold[off : off + t.numel()].copy_(t)
        off += t.numel()
    cold_s = time.perf_counter() - start
    return best, cold_s, best_cpu


def raw_zmq_send(sock, sd: dict, version: int, frame: int = MiB) -> None:
    for t in sd.values():
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        parts = [view[o : o + frame] for o in range(0, len(view), frame)]
        sock.send_multipart(parts, copy=False)
    sock.send(b"end%d" % version)


def wait_reports(
    results, kinds: tuple[str, ...], version: int, n: int, cpu_at: dict, timeout: float = 300
) -> dict[str, float]:
    """Per kind, the time at which the last of the n subscribers reported ``version``; each
    subscriber's process CPU seconds at its report go into ``cpu_at[(pid, kind)]``."""
    last, got = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0)
    deadline = time.monotonic() + timeout
    while min(got.values()) < n:
        k, v, t, _, pid, cpu = results.get(timeout=max(0.1, deadline - time.monotonic()))
        if k in got and v == version:
            got[k] += 1
            last[k] = max(last[k], t)
            cpu_at[(pid, k)] = cpu
    return last


def subscriber_cpu(cpu_at: dict, order: tuple[str, ...]) -> tuple[float, float]:
    """Mean CPU seconds a subscriber process spent on the zmq version and on the raw one of a
    round: from its report of the transport before, in ``order``, to its own (the transports
    take turns, so the others are idle meanwhile)."""
    pids = {pid for pid, _ in cpu_at}
    before = {kind: order[i - 1] for i, kind in enumerate(order) if i}
    zmq_s = [cpu_at[(p, "zmq")] - cpu_at[(p, before["zmq"])] for p in pids]
    raw_s = [cpu_at[(p, "raw")] - cpu_at[(p, before["raw"])] for p in pids]
    return sum(zmq_s) / len(pids), sum(raw_s) / len(pids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[100, 500, 1000], help="state dict sizes in MB")
    ap.add_argument("--subscribers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument(
        "--frame-mb", type=float, default=FRAME_BYTES / MiB, help="ZeroMQ frame size of the stream and of raw ZeroMQ"
    )
    ap.add_argument(
        "--message-mb",
        type=float,
        default=MESSAGE_BYTES / MiB,
        help="most tensor bytes in one message of the stream (a bucket is cut into such messages)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="publications per case; the best is kept (the first two write fresh /dev/shm pages; from the third on, the files of the version before last, which every subscriber acked, are recycled, as in a run)",
    )
    args = ap.parse_args()
    bucket = int(args.bucket_mb * MiB)
    spawn = mp.get_context("spawn")
    frame = int(args.frame_mb * MiB)
    out = {
        "commit": measured_commit(),
        "bucket_mb": args.bucket_mb,
        "frame_mb": args.frame_mb,
        "message_mb": args.message_mb,
        "cpu_count": os.cpu_count(),
        "cases": [],
    }
    out["load_average_at_start"] = os.getloadavg()
    version = 0
    for n in args.subscribers:
        shm_pub = ShmWeightPublisher("tcp://127.0.0.1:0", name="bench.shm", max_versions=2)
        zmq_pub = ZmqWeightPublisher(
            "tcp://127.0.0.1:0",
            name="bench.zmq",
            frame_bytes=frame,
            send_timeout_s=120,
            message_bytes=int(args.message_mb * MiB),
        )
        raw = zmq.Context.instance().socket(zmq.PUB)
        raw.setsockopt(zmq.SNDHWM, 0)
        raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
        results = spawn.Queue()
        readies = [spawn.Event() for _ in range(n)]
        procs = [
            spawn.Process(
                target=subscriber,
                args=(shm_pub.address, zmq_pub.address, f"tcp://127.0.0.1:{raw_port}", results, r),
                daemon=True,
            )
            for r in readies
        ]
        for p in procs:
            p.start()
        for r in readies:
            r.wait(120)
        time.sleep(0.5)
        for size_mb in args.sizes:
            sd = qwen2_like(int(size_mb * MB))
            nbytes = sum(t.numel() * 4 for t in sd.values())
            memcpy_s, memcpy_cold_s, _ = memcpy_seconds(sd)
            case = {
                "size_mb": round(nbytes / MB, 1),
                "subscribers": n,
                "memcpy_s": memcpy_s,
                "memcpy_cold_s": memcpy_cold_s,
            }
            best = {"shm": float("inf"), "shm_delivery": float("inf"), "zmq": float("inf"), "raw_zmq": float("inf")}
            extra = {"shm": 0, "zmq": 0}
            tracked = {"shm": 0, "zmq": 0}
            # The publisher's CPU seconds (all its threads): unlike wall time, they hardly move
            # when other jobs share the cores.
            cpu = dict.fromkeys(("memcpy", "shm", "zmq", "raw_zmq"), float("inf"))
            sub_cpu = {"zmq": float("inf"), "raw_zmq": float("inf")}
            rounds = []  # raw_s / zmq_s of each round
            for r in range(args.repeats):
                cpu_at: dict = {}
                # The baselines again in every round, best kept: on a shared machine a busy moment
                # must not land on one side of a ratio only.
                again, again_cold, again_cpu = memcpy_seconds(sd)
                memcpy_s, memcpy_cold_s = min(memcpy_s, again), min(memcpy_cold_s, again_cold)
                cpu["memcpy"] = min(cpu["memcpy"], again_cpu)
                # The stream and raw ZeroMQ take turns going first: neither always follows the other.
                order = ("shm", "zmq", "raw") if r % 2 == 0 else ("shm", "raw", "zmq")
                for kind in order:
                    if kind == "raw":
                        version += 1
                        start, cpu_start = time.monotonic(), time.process_time()
                        with PeakRss():  # the same sampler as the stream's, over the same span
                            raw_zmq_send(raw, sd, version, frame)
                            raw_round = wait_reports(results, ("raw",), version, n, cpu_at)["raw"] - start
                        cpu["raw_zmq"] = min(cpu["raw_zmq"], time.process_time() - cpu_start)
                        best["raw_zmq"] = min(best["raw_zmq"], raw_round)
                        continue
                    pub = shm_pub if kind == "shm" else zmq_pub
                    version += 1
                    start, cpu_start = time.monotonic(), time.process_time()
                    kinds = ("shm_delivery", "shm") if kind == "shm" else ("zmq",)
                    with PeakRss() as rss:
                        stats = pub.publish(state_dict_buckets(sd, bucket), version)
                        cpu_publish = time.process_time() - cpu_start
                        # zmq and raw ZeroMQ carry the sampler to the last report alike
                        reports = wait_reports(results, kinds, version, n, cpu_at) if kind == "zmq" else None
                    cpu[kind] = min(cpu[kind], cpu_publish)
                    reports = reports or wait_reports(results, kinds, version, n, cpu_at)
                    for k, t in reports.items():
                        best[k] = min(best[k], t - start)
                        if k == "zmq":
                            zmq_round = t - start
                    extra[kind] = max(extra[kind], rss.extra)
                    tracked[kind] = max(tracked[kind], stats.get("extra_bytes", 0))
                    shm_pub.poll()
                rounds.append(raw_round / zmq_round)
                round_zmq, round_raw = subscriber_cpu(cpu_at, order)
                sub_cpu["zmq"], sub_cpu["raw_zmq"] = min(sub_cpu["zmq"], round_zmq), min(sub_cpu["raw_zmq"], round_raw)
            case.update({"memcpy_s": memcpy_s, "memcpy_cold_s": memcpy_cold_s})
            case.update({f"publisher_cpu_s_{k}": v for k, v in cpu.items()})
            case.update({f"subscriber_cpu_s_{k}": v for k, v in sub_cpu.items()})
            # Where both paths are CPU-bound (two cores, several subscribers), time follows CPU:
            # the ratio of all processes' CPU seconds is the most zmq_vs_raw can reach there.
            all_raw = cpu["raw_zmq"] + n * sub_cpu["raw_zmq"]
            case["zmq_vs_raw_cpu"] = all_raw / (cpu["zmq"] + n * sub_cpu["zmq"])
            case.update({f"{k}_s": v for k, v in best.items()})
            case.update(
                {
                    "shm_GBps": nbytes / best["shm"] / 1e9,
                    "shm_delivery_GBps": nbytes / best["shm_delivery"] / 1e9,
                    "zmq_GBps": nbytes / best["zmq"] / 1e9,
                    "raw_zmq_GBps": nbytes / best["raw_zmq"] / 1e9,
                    "memcpy_GBps": nbytes / memcpy_s / 1e9,
                    "shm_vs_memcpy": memcpy_s / best["shm"],
                    "shm_vs_memcpy_cold": memcpy_cold_s / best["shm"],
                    "shm_delivery_vs_memcpy": memcpy_s / best["shm_delivery"],
                    "zmq_vs_raw": best["raw_zmq"] / best["zmq"],
                    "zmq_vs_raw_rounds": [round(r, 3) for r in rounds],
                    "zmq_vs_raw_median": statistics.median(rounds[1:] or rounds),
                    "zmq_vs_raw_spread": [min(rounds[1:] or rounds), max(rounds[1:] or rounds)],
                    "learner_extra_buckets_shm": extra["shm"] / bucket,
                    "learner_extra_buckets_zmq": extra["zmq"] / bucket,
                    "learner_buffer_buckets_zmq": tracked["zmq"] / bucket,
                    "shm_bytes": nbytes,
                }
            )
            print(json.dumps(case), file=sys.stderr, flush=True)
            out["cases"].append(case)
            del sd
        raw.send(b"stop")
        for p in procs:
            p.join(30)
        shm_pub.close()
        zmq_pub.close()
        raw.close()
    for key in ("shm_s", "shm_delivery_s", "zmq_s", "raw_zmq_s"):
        by_size = {}
        for c in out["cases"]:
            by_size.setdefault(c["size_mb"], {})[c["subscribers"]] = c[key]
        name = key.removesuffix("_s") + "_time_most_over_fewest_subscribers"
        out[name] = {str(s): v[max(v)] / v[min(v)] for s, v in by_size.items() if len(v) > 1}
    out["load_average"] = os.getloadavg()
    ratios = [c["zmq_vs_raw_median"] for c in out["cases"]]
    out["zmq_vs_raw_median_of_cases"] = statistics.median(ratios) if ratios else None
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
