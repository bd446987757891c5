"""The controller's two-phase checkpoint commit: the parts are asked for in order, each ask resent
until answered, and the checkpoint is committed only with every part in; an overtaken or late
checkpoint is abandoned with its staging folder."""

import json
import time

from asyncrl.config import RunConfig, dump_config
from asyncrl.controller.checkpointing import CheckpointCoordinator
from asyncrl.controller.commands import CommandSender
from asyncrl.rundir.checkpoints import latest_checkpoint, staging_dir
from asyncrl.wire.messages import CheckpointPartEvent


class Control:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def coordinator(tmp_path, **checkpoint):
    cfg = RunConfig(checkpoint=checkpoint) if checkpoint else RunConfig()
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    control = Control()
    return CheckpointCoordinator(cfg, tmp_path, CommandSender(control)), control


def saved(tmp_path, version, part):
    """A process wrote its part of checkpoint ``version`` into the staging folder."""
    path = staging_dir(tmp_path, version) / part
    if part.endswith(".json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"version": version, "dispatched": 8}))
    else:
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.bin").write_bytes(b"x")
    return CheckpointPartEvent(version=version, part=part)


def test_the_parts_are_asked_for_in_order_and_committed_with_all_in(tmp_path):
    c, control = coordinator(tmp_path)
    c.on_part(saved(tmp_path, 4, "learner"))
    assert [(b.command, b.roles) for b in control.sent] == [("checkpoint", ["buffer"])]
    assert set(c.commands.unacked) == {"buffer@4"}
    c.on_part(saved(tmp_path, 4, "buffer"))
    assert set(c.commands.unacked) == {"dispatcher@4"} and control.sent[-1].roles == ["dispatcher"]
    assert latest_checkpoint(tmp_path) is None  # not before the last part
    c.on_part(saved(tmp_path, 4, "dispatcher.json"))
    assert c.committed == [4] and c.pending is None and not c.commands.unacked
    assert latest_checkpoint(tmp_path).name.endswith("4") and control.sent[-1].command == "checkpoint_committed"


def test_an_overtaken_checkpoint_is_abandoned_and_a_late_answer_ignored(tmp_path):
    c, control = coordinator(tmp_path)
    c.on_part(saved(tmp_path, 4, "learner"))
    c.on_part(saved(tmp_path, 8, "learner"))  # the next one is due before 4 got its parts
    assert not staging_dir(tmp_path, 4).exists() and c.pending.version == 8
    assert set(c.commands.unacked) == {"buffer@8"}
    c.on_part(saved(tmp_path, 4, "buffer"))  # a late answer about 4
    assert set(c.commands.unacked) == {"buffer@8"} and c.committed == []


def test_a_checkpoint_past_its_deadline_is_abandoned(tmp_path):
    c, _ = coordinator(tmp_path, timeout_s=0.05)
    c.on_part(saved(tmp_path, 4, "learner"))
    c.expire()
    assert c.pending is not None
    time.sleep(0.1)
    c.expire()
    assert c.pending is None and not c.commands.unacked and not staging_dir(tmp_path, 4).exists()
