"""Control-plane message rate: trajectories per second through the wire codec and ZeroMQ.

One process, one core: a sender thread encodes groups (n samples of ``--tokens`` response tokens,
int32 ids + float32 logprobs) and pushes them; the main thread receives, decodes and validates
them, exactly as the reward worker and buffer do. Prints one JSON object with trajectories/s,
messages/s and MB/s, plus the codec alone (encode + decode, no socket) as the baseline.

    OMP_NUM_THREADS=1 .venv/bin/python bench/control_plane.py [--tokens 1024] [--n 8] [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from asyncrl import wire
from asyncrl.transport import StreamReceiver, StreamSender


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
        "push_pull_decode": through_sockets(group, args.seconds),
        "goal_trajectories_per_s": 50_000,
    }
    result["fraction_of_goal"] = result["push_pull_decode"]["trajectories_per_s"] / 50_000
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
