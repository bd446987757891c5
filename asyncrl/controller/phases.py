"""Where a run's wall time goes, phase by phase: the summary's ``phases_s``.

The phases follow the lifecycle (``asyncrl.controller.lifecycle``): ``prepare`` (the run
directory, the starting model, the held-out prompts), ``start`` (every process started until all
report ready; when each did, in ``phase_parts_s["start"]``), ``eval_before``, ``train`` (go until
the learner's last step and its checkpoint), ``drain`` (the dispatcher stopped, every generator
serving the final weights), ``eval_after``, ``stop`` (the rest of the dataflow stopped stage by
stage; each stage's seconds in ``phase_parts_s["stop"]``) and ``finish`` (the processes reaped,
the summary written). They add up to the summary's ``total_wall_s``; the time before the
controller starts (the interpreter and its imports) is the command's, not the run's. A restore
during a phase counts in that phase.
"""

from __future__ import annotations

import time


class PhaseClock:
    """Laps of one wall clock: each ``lap(name)`` charges the time since the previous lap to
    ``name`` (added up when a phase comes again)."""

    def __init__(self, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.mark = self.start
        self.seconds: dict[str, float] = {}
        """Phase -> wall seconds, in the order the phases first came."""
        self.parts: dict[str, dict[str, float]] = {}
        """Phase -> its parts' seconds (each process's start to ready, the stop's stages), within
        the phase's own."""

    def lap(self, name: str) -> float:
        """Charge the time since the last lap to ``name``; returns that time."""
        now = time.monotonic()
        spent = now - self.mark
        self.seconds[name] = self.seconds.get(name, 0.0) + spent
        self.mark = now
        return spent

    def part(self, phase: str, name: str, seconds: float) -> None:
        """Record ``seconds`` of ``phase`` spent on ``name`` (within the phase's lap)."""
        parts = self.parts.setdefault(phase, {})
        parts[name] = parts.get(name, 0.0) + seconds
