"""Start real component processes without the controller: the test plays the controller."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from asyncrl.config import RunConfig, dump_config
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import Event, FinalReport, StopCommand
from asyncrl.wire.sockets import Publisher, StreamReceiver


class Harness:
    def __init__(self, run_dir: Path, cfg: RunConfig):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        self.endpoints = Endpoints.allocate()
        self.endpoints.save(run_dir)
        self.events = StreamReceiver(self.endpoints.events, name="harness.events")
        self.control = Publisher(self.endpoints.control, name="harness.control")
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen: list[dict] = []

    def start(self, role: str, name: str, model_dir: str = "none") -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(self.run_dir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.fleet.child", role, name, str(self.run_dir), model_dir],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_for(self, source: str, type: str, timeout: float = 60) -> Event:
        """The first event of ``type`` from ``source`` (``final``: its final report, whatever its role)."""
        for ev in self.seen:
            if ev.source == source and _is(ev, type):
                return ev
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                assert p.poll() in (None, 0), f"{name} died (exit {p.poll()}): {_ends(self.run_dir / f'{name}.log')}"
            msg = self.events.recv(timeout=0.2)
            if msg is None:
                continue
            self.seen.append(msg[1])
            if msg[1].source == source and _is(msg[1], type):
                return msg[1]
        raise TimeoutError(f"no {type!r} event from {source} within {timeout} s")

    def stop(self, roles: list[str], names: list[str], timeout: float = 30) -> dict[str, FinalReport]:
        """Stop ``roles`` and return each of ``names``' final report (its role's type)."""
        finals = {}
        deadline = time.monotonic() + timeout
        while len(finals) < len(names) and time.monotonic() < deadline:
            self.control.send(StopCommand(roles=roles))
            for n in names:
                if n not in finals:
                    try:
                        finals[n] = self.wait_for(n, "final", timeout=0.3)
                    except TimeoutError:
                        pass
        assert len(finals) == len(names), f"no final report from {set(names) - set(finals)}"
        return finals

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.events.close()
        self.control.close()


def _is(ev: Event, type: str) -> bool:
    return ev.final if type == "final" else ev.type == type


def metric(port: int, name: str, labels: str) -> float:
    """One sample of a process's /metrics (0 when absent): ``name`` with ``labels`` among its labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def process_metric(run_dir: Path, process: str, name: str, labels: str) -> float:
    """``metric`` of the named process of a run (0 until it has written its metrics port)."""
    port_file = run_dir / "metrics" / f"{process}.port"
    return metric(int(port_file.read_text()), name, labels) if port_file.exists() else 0.0


def _ends(log_path) -> str:
    """A dead process's log, its first error and its last words: the cause is usually at the
    start, the shutdown noise at the end."""
    text = log_path.read_text()
    return text if len(text) <= 4000 else f"{text[:2000]}\n[...]\n{text[-2000:]}"
