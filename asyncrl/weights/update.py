"""What a subscriber hands the generator: one verified version of the weights.

``WeightUpdate.tensors`` are zero-copy views of the transport's buffers (shared memory, ZeroMQ
frames); they stay valid until ``done()``, which the generator calls once the engine has copied
them in (or failed to): it releases the buffers and, on transports with a back channel, tells
the learner that this subscriber no longer needs the version (an ack, or the error).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class WeightSyncError(RuntimeError):
    """A weight update that failed verification (checksum, order, names, probe) or arrived incomplete."""


@dataclass
class WeightUpdate:
    """One complete, checksum-verified version of the weights."""

    version: int
    """The learner's step count (one per batch) that produced these weights."""
    tensors: list[tuple[str, torch.Tensor]]
    """(HF parameter name, tensor) in the learner's order; views, valid until ``done()``."""
    meta: dict = field(default_factory=dict)
    """What the learner sent along (e.g. ``probe``: a prompt, continuation and its logprobs)."""
    nbytes: int = 0
    """Bytes of tensor data received."""
    receive_s: float = 0.0
    """Seconds from the first byte (or the announcement) to verified tensors."""
    announced_at: float = 0.0
    """``time.monotonic()`` when the whole version was announced to (shm) or had arrived at this subscriber."""
    path: str | None = None
    """For the file transport: the directory to load instead of ``tensors``."""
    shm: list[dict] | None = None
    """For the shm transport: each bucket's ``{path, nbytes, tensors}``, so that an engine in another
    process (vLLM's AsyncLLM core) can map the same pages itself instead of receiving a copy."""
    ready_at: float = field(default_factory=time.time)
    """Wall clock when the subscriber had this version received and verified (set when the update
    is made): from it to the generator's serving it, the version waited for the batch being sampled."""
    _on_done: Callable[[str | None], None] | None = None

    def done(self, error: str | None = None) -> None:
        """Release the buffers and report the outcome (``error`` None means applied)."""
        self.tensors = []
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb(error)
