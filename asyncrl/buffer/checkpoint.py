"""The buffer's part of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.buffer.replay import ReplayBuffer


def save_checkpoint_part(buf: ReplayBuffer, stage: Path) -> None:
    """The buffer's part of a checkpoint: its snapshot and the ids of the groups it holds (which
    the dispatcher then need not hand out again on resume). Idempotent: the controller repeats
    the command until it hears back."""
    if (stage / "buffer").exists():
        return
    buf.snapshot(stage / "buffer")
    ids = stage / "buffer" / "buffer_ids.json"
    ids.write_text(json.dumps(buf.stored_group_ids()))
