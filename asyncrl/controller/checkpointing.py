"""The controller's side of a checkpoint: the two-phase commit over the learner, buffer and
dispatcher parts, and the restore point of a resumed or restored run.

The learner saves its part at a version and says so; the controller then asks the buffer, then
the dispatcher, for theirs, in that order (``asyncrl.rundir.checkpoints`` says why), each ask
resent until answered; with all three in the staging folder it commits the checkpoint, tells
the dispatcher, and compacts the group ledger at the older of the last two checkpoints committed
(a restore goes back to the newest one that verifies, never further: ``asyncrl.rundir.ledger_replay``). A checkpoint not committed within ``checkpoint.timeout_s``, or overtaken by the
learner's next one, is abandoned and its staging folder removed.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.controller.commands import CommandSender
from asyncrl.rundir.checkpoints import commit, discard_staging, latest_checkpoint, staging_dir
from asyncrl.rundir.ledger import LedgerWriter
from asyncrl.rundir.ledger_replay import compact_ledger
from asyncrl.wire.messages import CheckpointCommand, CheckpointCommittedCommand, CheckpointPartEvent

log = logging.getLogger("asyncrl")

PARTS = ["learner", "buffer", "dispatcher.json", "config.yaml"]
"""What a committed checkpoint holds."""


@dataclass
class PendingCheckpoint:
    version: int
    deadline: float
    """Monotonic time past which it is abandoned."""


class CheckpointCoordinator:
    """Owns the checkpoint being written (at most one) and the versions committed."""

    def __init__(self, cfg: RunConfig, run_dir: Path, commands: CommandSender):
        self.cfg = cfg
        self.run_dir = run_dir
        self.commands = commands
        self.pending: PendingCheckpoint | None = None
        self.committed: list[int] = []

    def on_part(self, ev: CheckpointPartEvent) -> None:
        """A process saved its part at a version: ask for the next part, or commit."""
        version, part = ev.version, ev.part
        stage = staging_dir(self.run_dir, version)
        if part == "learner":
            if self.pending is not None:
                log.warning("checkpoint %d abandoned: the next one (%d) is due", self.pending.version, version)
                self.abandon()
            self.pending = PendingCheckpoint(version, time.monotonic() + self.cfg.checkpoint.timeout_s)
            self.commands.send("buffer", CheckpointCommand(dir=str(stage), version=version), ack=f"buffer@{version}")
        elif self.pending is None or self.pending.version != version:
            return  # a late answer about an abandoned checkpoint
        elif part == "buffer":
            self.commands.acked(f"buffer@{version}")
            self.commands.send(
                "dispatcher", CheckpointCommand(dir=str(stage), version=version), ack=f"dispatcher@{version}"
            )
        elif part == "dispatcher.json":
            self.commands.acked(f"dispatcher@{version}")
            shutil.copy2(self.run_dir / "config.yaml", stage / "config.yaml")  # the resolved config it ran with
            path = commit(
                self.run_dir,
                version,
                PARTS,
                meta={"run": self.cfg.run.name, "samples_per_group": self.cfg.sampling.n},
                keep_last=self.cfg.checkpoint.keep_last,
            )
            self.committed.append(version)
            self.pending = None
            self.commands.send("dispatcher", CheckpointCommittedCommand(version=version))
            log.info("checkpoint committed: %s", path)
            if len(self.committed) >= 2:
                done = compact_ledger(self.run_dir, fold_version=self.committed[-2])
                log.info("ledger compacted at version %d: %s", self.committed[-2], done)

    def expire(self) -> None:
        """Abandon the pending checkpoint once past its deadline."""
        if self.pending is not None and time.monotonic() > self.pending.deadline:
            log.error(
                "checkpoint %d abandoned: no answer within %.0f s",
                self.pending.version,
                self.cfg.checkpoint.timeout_s,
            )
            self.abandon()

    def abandon(self) -> None:
        """Stop asking for the pending checkpoint's parts and remove its staging folder."""
        if self.pending is None:
            return
        version = self.pending.version
        for key in (f"buffer@{version}", f"dispatcher@{version}"):
            self.commands.acked(key)
        shutil.rmtree(staging_dir(self.run_dir, version), ignore_errors=True)
        self.pending = None


def restore_point(run_dir: Path, ledger: LedgerWriter) -> Path | None:
    """The newest verified checkpoint (None: the run starts over); writes the ledger's restore
    mark for it and removes every staging folder left by the run that stopped."""
    discard_staging(run_dir)
    path = latest_checkpoint(run_dir)
    if path is None:
        version = dispatched = 0
        log.warning("no checkpoint in %s: the run starts over", run_dir)
    else:
        state = json.loads((path / "dispatcher.json").read_text())
        version, dispatched = int(state["version"]), int(state["dispatched"])
        log.info("restoring the run from %s (version %d)", path, version)
    ledger.write("restore", version=version, dispatched=dispatched)
    return path
