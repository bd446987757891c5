"""Several simulated generators in one process: the fleet of the scale benchmark on two cores.

A generator process normally runs one loop around one engine (``worker.run_generator``). With
simulated engines (``simulation.generator.engines_per_process`` = E > 1) a process instead runs E
of those same loops, one thread each: a simulated engine sleeps while it "generates" and a
socket wait releases the GIL, so hundreds of loops fit on a few cores, and each still has its own
engine, sockets, name (``generator-<index>``: the dispatcher tells them apart by it) and seed.
Nothing in the loop changes; it talks to a ``LoopContext`` instead of the process's context.

To the controller the process is one generator, as it is in the process table: it reports ready
when all its loops are, the version they all serve (the lowest), and one final report whose
counters are the sums over its loops, so the ledger check and the busy fraction
(Σ busy / Σ wall) come out as for E processes. A loop that fails stops the others, and the
process fails with its error.
"""

from __future__ import annotations

import logging
import math
import threading

import msgspec

from asyncrl.generators.context import GeneratorContext
from asyncrl.wire.messages import EvalResult

log = logging.getLogger(__name__)


def engines_per_process(cfg) -> int:
    """E: simulated engines per generator process (1 with real engines)."""
    return cfg.simulation.generator.engines_per_process if cfg.simulation.generator is not None else 1


def generator_process_names(cfg) -> list[str]:
    """Names of the generator processes the controller starts: ``generator-<i>`` for one engine
    each, else ``generators-<p>``, each holding E of the ``run.num_generators`` loops."""
    per, total = engines_per_process(cfg), cfg.run.num_generators
    if per == 1:
        return [f"generator-{i}" for i in range(total)]
    return [f"generators-{p}" for p in range(math.ceil(total / per))]


def loop_names(cfg, process_name: str) -> list[str]:
    """The generator loops a process named by ``generator_process_names`` runs."""
    per, total = engines_per_process(cfg), cfg.run.num_generators
    if per == 1:
        return [process_name]
    first = int(process_name.rsplit("-", 1)[1]) * per
    return [f"generator-{i}" for i in range(first, min(first + per, total))]


class _Merged:
    """The events of a process's loops, folded into the events of one generator."""

    def __init__(self, names: list[str]):
        self.names = names
        self.ready: set[str] = set()
        self.versions: dict[str, int] = {}
        self.finals: dict[str, dict] = {}
        self.reported_version = -1

    def fold(self, name: str, type: str, fields: dict) -> list[tuple[str, dict]]:
        """Events to send for loop ``name``'s event: none until every loop has said as much."""
        if type == "ready":
            self.ready.add(name)
            self.versions[name] = fields.get("version", 0)
            if len(self.ready) < len(self.names):
                return []
            self.reported_version = min(self.versions.values())
            return [("ready", {"version": self.reported_version})]
        if type == "version":
            self.versions[name] = fields["version"]
            lowest = min(self.versions.values())
            if len(self.versions) < len(self.names) or lowest <= self.reported_version:
                return []
            self.reported_version = lowest
            return [("version", {**fields, "version": lowest})]
        if type == "final":
            self.finals[name] = fields
            if len(self.finals) < len(self.names):
                return []
            finals = list(self.finals.values())
            dropped: dict[str, int] = {}
            for f in finals:
                for reason, count in f.get("dropped", {}).items():
                    dropped[reason] = dropped.get(reason, 0) + count
            summed = {k: sum(f[k] for f in finals) for k in ("generated", "tokens", "held", "busy_s", "wall_s")}
            return [("final", {**summed, "dropped": dropped, "version": min(f["version"] for f in finals)})]
        return [(type, {**fields, "loop": name})]


class LoopContext:
    """What one generator loop sees of its process's context (a ``GeneratorContext``): its own
    name, shared sockets behind a lock (ZeroMQ sockets are not thread-safe), merged events, a
    shared stop."""

    def __init__(
        self, parent: GeneratorContext, name: str, merged: _Merged, lock: threading.Lock, failed: threading.Event
    ):
        self.parent, self.name, self.merged, self.lock, self.failed = parent, name, merged, lock, failed
        self.cfg = parent.cfg
        self.endpoints = parent.endpoints
        self.ledger = _LockedLedger(parent.ledger, lock) if hasattr(parent, "ledger") else None

    def emit(self, type: str, **fields) -> None:
        with self.lock:
            for kind, body in self.merged.fold(self.name, type, fields):
                self.parent.emit(kind, **body)

    def report(self, message: EvalResult) -> None:
        with self.lock:
            self.parent.report(msgspec.structs.replace(message, loop=self.name))

    def stop_requested(self) -> bool:
        if self.failed.is_set():
            return True
        with self.lock:
            return self.parent.stop_requested()


class _LockedLedger:
    def __init__(self, ledger, lock: threading.Lock):
        self.ledger, self.lock = ledger, lock

    def write(self, *args, **kwargs):
        with self.lock:
            return self.ledger.write(*args, **kwargs)


def run_generator_process(ctx: GeneratorContext, model_dir: str) -> None:
    """The generator process: one loop, or E loops in threads (see the module docstring)."""
    from asyncrl.generators.process import run_generator

    names = loop_names(ctx.cfg, ctx.name)
    if names == [ctx.name]:
        run_generator(ctx, model_dir)
        return
    merged, lock, failed = _Merged(names), threading.Lock(), threading.Event()
    errors: list[BaseException] = []

    def loop(name: str) -> None:
        try:
            run_generator(LoopContext(ctx, name, merged, lock, failed), model_dir)
        except BaseException as e:  # stop the other loops, then fail the process with this error
            log.exception("%s: generator loop %s failed", ctx.name, name)
            errors.append(e)
            failed.set()

    threads = [threading.Thread(target=loop, args=(n,), name=n, daemon=True) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
