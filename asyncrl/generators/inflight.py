"""Swap weights while requests run: a background thread applies each newly announced version.

With ``weights.apply_mode: in_flight`` the generator samples through ``AsyncVLLMEngine`` and
this applier polls the subscriber every ``poll_s`` seconds from its own thread; a new version
goes in through ``apply_newest_weights`` (verify, swap, probe) while the main thread waits on
``generate``. The main thread calls ``drain(ctx)`` once per turn: the events the applier
recorded are emitted from there (the controller's event socket belongs to the main thread),
and a failure the applier met is raised there, so it is never swallowed and the generator
stops sampling with weights it cannot vouch for.

In a generator's loop (it needs a live engine and subscriber, so not a doctest)::

    applier = InFlightApplier(engine, subscriber, ProbeCheck(atol=1e-3))
    while running: applier.drain(ctx); engine.generate(...)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from asyncrl.generators.context import GeneratorContext
from asyncrl.generators.weights_apply import apply_newest_weights
from asyncrl.weights.probe import ProbeCheck
from asyncrl.wire.messages import Event

log = logging.getLogger(__name__)


class InFlightApplier:
    """Applies announced weights to ``engine`` from a background thread (see the module docstring)."""

    def __init__(
        self,
        engine,
        weights,
        probe: ProbeCheck | None,
        poll_s: float = 0.05,
        name: str = "generator",
        held: Callable[[], bool] = lambda: False,
    ):
        if poll_s <= 0:
            raise ValueError(f"poll_s ({poll_s}) must be > 0")
        self.engine = engine
        self.weights = weights
        self.probe = probe
        self.poll_s = poll_s
        self.name = name
        self.held = held
        """True while publications must wait (``asyncrl.generators.weights_hold``)."""
        self.error: BaseException | None = None
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}.weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.held():
                    apply_newest_weights(self.engine, self.weights, self, self.probe)
            except BaseException as e:  # handed to the main thread by drain(): never swallowed
                log.error("%s: applying weights in flight failed: %s: %s", self.name, type(e).__name__, e)
                self.error = e
                return
            self._stop.wait(self.poll_s)

    def emit(self, event: Event) -> None:
        """What ``apply_newest_weights`` reports, kept for the main thread."""
        with self._lock:
            self._events.append(event)

    def drain(self, ctx: GeneratorContext) -> None:
        """Emit the recorded events through ``ctx``; raise the applier's failure, if any."""
        with self._lock:
            events, self._events = self._events, []
        for event in events:
            ctx.emit(event)
        if self.error is not None:
            raise self.error

    def close(self, timeout: float = 30.0) -> None:
        """Stop polling; waits up to ``timeout`` s for a swap in progress to finish."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s: the weight applier was still swapping after %.0f s", self.name, timeout)
