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
from asyncrl.wire.messages import EvalResult, Event, GeneratorFinal, ReadyEvent, VersionEvent

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
        self.finals: dict[str, GeneratorFinal] = {}
        self.reported_version = -1

    def fold(self, name: str, event: Event) -> list[Event]:
        """Events to send for loop ``name``'s ``event``: none until every loop has said as much."""
        if isinstance(event, ReadyEvent):
            self.ready.add(name)
            self.versions[name] = event.version or 0
            if len(self.ready) < len(self.names):
                return []
            self.reported_version = min(self.versions.values())
            return [ReadyEvent(version=self.reported_version)]
        if isinstance(event, VersionEvent):
            self.versions[name] = event.version
            lowest = min(self.versions.values())
            if len(self.versions) < len(self.names) or lowest <= self.reported_version:
                return []
            self.reported_version = lowest
            return [msgspec.structs.replace(event, version=lowest)]
        if isinstance(event, GeneratorFinal):
            self.finals[name] = event
            if len(self.finals) < len(self.names):
                return []
            return [sum_finals(list(self.finals.values()))]
        return [msgspec.structs.replace(event, loop=name)]


def sum_finals(finals: list[GeneratorFinal]) -> GeneratorFinal:
    """One generator's final report from its loops': counts and seconds summed, drops summed by
    reason, the lowest version."""
    dropped: dict[str, int] = {}
    for f in finals:
        for reason, count in f.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
    summed = ("generated", "tokens", "held", "busy_s", "wall_s", "eval_prompts", "eval_s", "resumed")
    return GeneratorFinal(
        **{k: sum(getattr(f, k) for f in finals) for k in summed},
        dropped=dropped,
        version=min(f.version for f in finals),
    )


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

    def emit(self, event: Event) -> None:
        with self.lock:
            for merged in self.merged.fold(self.name, event):
                self.parent.emit(merged)

    def report(self, message: EvalResult) -> None:
        with self.lock:
            self.parent.report(msgspec.structs.replace(message, loop=self.name))

    def stop_requested(self) -> bool:
        if self.failed.is_set():
            return True
        with self.lock:
            return self.parent.stop_requested()

    @property
    def go_command(self):
        """The process's go (read by every loop: ``asyncrl.generators.weights_hold``)."""
        return self.parent.go_command

    @property
    def weights_released(self) -> bool:
        return self.parent.weights_released


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
