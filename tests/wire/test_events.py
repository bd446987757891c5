"""Events and commands are tagged unions inside their kind: each decodes to its declared type,
and one of an unknown type, a missing or a mistyped field is rejected with a named reason."""

import pytest

from asyncrl.wire import WireError, decode, encode, encode_map
from asyncrl.wire.messages import (
    COMMANDS,
    EVENTS,
    CheckpointCommand,
    RequeuedEvent,
    StepEvent,
    StopCommand,
    VersionEvent,
)


def step(**fields):
    body = dict(version=3, loss=0.5, reward=1.0, accuracy=None, tokens=12, samples=4, wait_s=0.1, step_s=0.2)
    return StepEvent(source="learner", role="learner", staleness_mean=0.5, staleness_max=1, **{**body, **fields})


def test_an_event_travels_as_its_flat_map_and_decodes_to_its_type():
    kind, ev = decode(encode(step(clipfrac=0.25)))
    assert kind == "event" and isinstance(ev, StepEvent) and ev.type == "step"
    assert ev.version == 3 and ev.clipfrac == 0.25 and ev.accuracy is None
    record = ev.as_map()
    # an optional stat left unset is not in the map; a required one that is None is
    assert "entropy" not in record and record["accuracy"] is None and "kind" not in record
    assert record["type"] == "step" and record["source"] == "learner"
    assert set(EVENTS) >= {"ready", "error", "step", "done", "version", "broadcast", "final", "checkpoint_part"}


def test_a_command_decodes_to_its_type():
    kind, command = decode(encode(CheckpointCommand(dir="/ckpt", version=4, roles=["buffer"], id="buffer@4")))
    assert kind == "control" and isinstance(command, CheckpointCommand) and command.command == "checkpoint"
    assert (command.dir, command.version, command.roles, command.id) == ("/ckpt", 4, ["buffer"], "buffer@4")
    assert isinstance(decode(encode(StopCommand()))[1], StopCommand)
    assert set(COMMANDS) == {"stop", "go", "requeue", "checkpoint", "checkpoint_committed"}


@pytest.mark.parametrize(
    "kind, body",
    [
        ("event", {"type": "gossip", "source": "x"}),  # an event type nobody declared
        ("event", {"source": "x"}),  # no type at all
        ("event", {"type": "requeued", "scope": "generator"}),  # a required field missing
        ("event", {"type": "done", "version": "three"}),  # a mistyped field
        ("control", {"command": "explode"}),
        ("control", {"command": "checkpoint", "dir": "/ckpt", "version": -1}),  # out of bounds
    ],
)
def test_a_malformed_event_or_command_is_rejected_with_a_named_reason(kind, body):
    with pytest.raises(WireError) as err:
        decode(encode_map(kind, body))
    assert err.value.reason == "bad_fields"


def test_fields_an_event_does_not_declare_fail_at_the_sender():
    with pytest.raises(TypeError):
        RequeuedEvent(scope="generator", groups=1, colour="blue")
    assert decode(encode_map("event", {"type": "requeued", "scope": "g", "groups": 0, "colour": "blue"}))[1] == (
        RequeuedEvent(scope="g", groups=0)
    )  # a receiver ignores keys it does not know (a newer sender's)


def test_a_version_event_keeps_a_ready_time_that_is_none():
    ev = VersionEvent(
        version=2, apply_s=0.1, load_s=0.05, receive_s=0.02, probe_s=0.0, ready_at=None, served_at=10.0, bytes=64
    )
    assert decode(encode(ev))[1] == ev and ev.as_map()["ready_at"] is None
