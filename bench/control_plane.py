"""Control-plane message rate: trajectories per second through the wire codec and ZeroMQ.

Groups of n samples of ``--tokens`` response tokens (int32 ids + float32 logprobs) are encoded,
pushed, received, decoded and validated, exactly as a generator sends them and a reward worker or
the buffer takes them in. Three figures, in one run:

- ``codec_only`` (the baseline): encode + decode + validate in one thread, no socket;
- ``receiver_one_core``: what one control-plane process sustains. The receiving process is pinned
  to one core and does what the reward worker and buffer do per message (receive, decode,
  validate); the sender, a stand-in for the generators, is another process on another core;
- ``push_pull_decode``: both ends in one process on one core (a sender thread encodes while the
  main thread receives and decodes: they share the interpreter lock), the harshest reading.

Prints one JSON object with trajectories/s, messages/s and MB/s for each.

    OMP_NUM_THREADS=1 .venv/bin/python bench/control_plane.py [--tokens 1024] [--n 8] [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time

import numpy as np

from asyncrl import wire
from asyncrl.wire.sockets import StreamReceiver, StreamSender


def make_group(index: int, n: int, tokens: int) -> wire.Group:
    rng = np.random.default_rng(index)
    samples = [
        wire.Sample(
            uid=f"g{index}/{i}",
            response_ids=rng.integers(0, 32000, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32),
            text="",
            finish_reason="stop",
            reward=1.0,
        )
        for i in range(n)
    ]
    return wire.Group(
        group_id=f"g{index}",
        prompt_uid="p",
        task="addition",
        prompt="",
        answer="",
        prompt_ids=np.arange(256, dtype=np.int32),
        policy_version=0,
        generator="bench",
        samples=samples,
    )


def codec_only(group: wire.Group, seconds: float) -> dict:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        wire.decode(wire.encode_group(group))
        count += 1
    elapsed = time.perf_counter() - start
    return {"messages_per_s": count / elapsed, "trajectories_per_s": count * len(group.samples) / elapsed}


def through_sockets(group: wire.Group, seconds: float) -> dict:
    rx = StreamReceiver("tcp://127.0.0.1:*", name="bench.rx", hwm=100)
    tx = StreamSender(rx.address, name="bench.tx", hwm=100)
    stop = threading.Event()

    def send():
        while not stop.is_set():
            try:
                tx.send_frame(wire.encode_group(group), timeout=1)
            except TimeoutError:
                return  # the receiver has stopped reading: the measurement is over

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    rx.recv(timeout=5)  # warm up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        rx.recv(timeout=5)
        count += 1
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join(5)
    frame_bytes = len(wire.encode_group(group))
    tx.close()
    rx.close()
    return {
        "messages_per_s": count / elapsed,
        "trajectories_per_s": count * len(group.samples) / elapsed,
        "mb_per_s": count * frame_bytes / elapsed / 1e6,
        "frame_bytes": frame_bytes,
    }


def _sender_process(address: str, n: int, tokens: int, core: int | None, stop) -> None:
    """The generators' side, in its own process: encode and push groups until told to stop."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    group = make_group(0, n, tokens)
    tx = StreamSender(address, name="bench.tx", hwm=100)
    while not stop.is_set():
        try:
            tx.send_frame(wire.encode_group(group), timeout=1)
        except TimeoutError:
            continue
    tx.close()


def receiver_one_core(group: wire.Group, seconds: float) -> dict:
    """Receive, decode and validate on one core while another process sends."""
    cores = sorted(os.sched_getaffinity(0))
    rx_core, tx_core = cores[0], (cores[1] if len(cores) > 1 else None)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {rx_core})
    rx = StreamReceiver("tcp://127.0.0.1:*", name="bench.rx", hwm=100)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    sender = ctx.Process(
        target=_sender_process, args=(rx.address, len(group.samples), len(group.samples[0].response_ids), tx_core, stop)
    )
    sender.start()
    try:
        if rx.recv(timeout=60) is None:
            raise RuntimeError("the sender process sent nothing within 60 s")
        count, cpu0, start = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - start < seconds:
            if rx.recv(timeout=5) is None:
                raise RuntimeError("the sender process stopped sending")
            count += 1
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    finally:
        stop.set()
        sender.join(10)
        if sender.is_alive():
            sender.kill()
        rx.close()
        os.sched_setaffinity(0, before)
    return {
        "messages_per_s": count / elapsed,
        "trajectories_per_s": count * len(group.samples) / elapsed,
        "mb_per_s": count * len(wire.encode_group(group)) / elapsed / 1e6,
        "receiver_cpu_us_per_trajectory": 1e6 * cpu / (count * len(group.samples)),
        "receiver_core": rx_core,
        "sender_core": tx_core,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    group = make_group(0, args.n, args.tokens)
    result = {
        "tokens": args.tokens,
        "n": args.n,
        "codec_only": codec_only(group, args.seconds),
        "receiver_one_core": receiver_one_core(group, args.seconds),
        "push_pull_decode": through_sockets(group, args.seconds),
        "goal_trajectories_per_s": 50_000,
        "load_average": os.getloadavg(),  # the machine is shared: what else ran meanwhile
    }
    result["fraction_of_goal"] = result["receiver_one_core"]["trajectories_per_s"] / 50_000
    result["fraction_of_goal_both_ends_one_core"] = result["push_pull_decode"]["trajectories_per_s"] / 50_000
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
