"""Benchmark: HTTP reward throughput against a local server that answers after a fixed delay.

With C requests in flight and a server answering after d seconds, the ideal is C / d requests per
second. For C in (8, 32, 128) this scores ``rounds · C`` samples (groups of 8, all submitted at
once, the client's semaphore holding C in flight) through ``JsonScorerReward`` and prints one
JSON object: throughput, its ratio to C / d, and the client process's CPU seconds per request.
The server runs in a child process (a bare asyncio HTTP/1.1 server), so its CPU is not counted.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rewards.py [--delay 0.2] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


RESPONSE = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n{"score": 1.0}'


class _DelayedScorer(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server answering every request after ``delay`` seconds: the
    benchmark measures the client, so the server should cost as little CPU as possible."""

    def __init__(self, delay: float):
        self.delay = delay
        self.buffer = b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        loop = asyncio.get_running_loop()
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            loop.call_later(self.delay, self._answer)

    def _answer(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(RESPONSE)


def serve(port: int, delay: float) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _DelayedScorer(delay), "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_level(url: str, concurrency: int, rounds: int) -> dict:
    from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward
    from tests.factories import make_group

    reward = JsonScorerReward("bench", JsonScorerConfig(url=url, concurrency=concurrency, timeout_s=30, max_retries=0))
    groups = [make_group(f"c{concurrency}-g{i}", n=8) for i in range(max(1, rounds * concurrency // 8))]
    await asyncio.gather(*(reward.score(make_group(f"warm{i}", n=8)) for i in range(max(1, concurrency // 8))))
    cpu0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(reward.score(g) for g in groups))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await reward.close()
    n = sum(len(r) for r in results)
    failed = sum(1 for r in results for x in r if not isinstance(x, float))
    return {
        "requests": n,
        "failed": failed,
        "wall_s": round(wall, 3),
        "per_s": round(n / wall, 1),
        "cpu_ms_per_request": round(1000 * cpu / n, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--levels", default="8,32,128")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.delay)
        return
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--delay", str(args.delay)])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        out = {"server_delay_s": args.delay, "levels": {}}
        for c in (int(x) for x in args.levels.split(",")):
            level = asyncio.run(run_level(f"http://127.0.0.1:{port}/score", c, args.rounds))
            level["ideal_per_s"] = round(c / args.delay, 1)
            level["ratio_to_ideal"] = round(level["per_s"] / level["ideal_per_s"], 3)
            out["levels"][str(c)] = level
        out["all_at_least_90_percent"] = all(v["ratio_to_ideal"] >= 0.9 for v in out["levels"].values())
        print(json.dumps(out, indent=2))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
