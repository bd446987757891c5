"""Learning-rate schedules: the learning rate of each optimizer update, a pure function of its index.

For update s = 0, 1, ... (counted over the whole run, ``ppo_epochs × mini_batches`` per learner
step), with peak rate lr, W warm-up updates, T the updates of the schedule and floor
r = ``min_lr_ratio``:

    warm-up (s < W):   lr_s = lr · (s + 1) / W
    after it:          p    = min(1, (s - W) / max(1, T - W))                (progress in [0, 1])
        constant:      lr_s = lr
        linear:        lr_s = lr · (r + (1 - r) · (1 - p))
        cosine:        lr_s = lr · (r + (1 - r) · (1 + cos(π p)) / 2)

so the decay reaches lr · r at update T and stays there. The schedule's only state is the update
index, which the trainer saves with its checkpoint: a resumed run continues the schedule exactly.

Where this differs from Hugging Face's ``get_cosine_schedule_with_warmup`` (which verl and
OpenRLHF use): the warm-up's first update already has rate lr / W, not 0 — an update at rate 0
moves no weight but still advances Adam's moments and counts against the schedule — and the
floor r is part of the formula, as in verl's ``min_lr_ratio``.
"""

from __future__ import annotations

import math
from typing import Literal

LRSchedule = Literal["constant", "linear", "cosine"]


def lr_factor(step: int, schedule: LRSchedule, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """lr_s / lr for update ``step`` (0-based): see the module's formulas."""
    if step < 0:
        raise ValueError(f"step ({step}) must be >= 0")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio ({min_lr_ratio}) must be in [0, 1]")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"schedule ({schedule!r}) must be one of constant, linear, cosine")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape
