"""Events and commands are tagged unions inside their kind: each decodes to its declared type,
and one of an unknown type, a missing or a mistyped field is rejected with a named reason."""

import pytest

from asyncrl.observability.step_stats import StepStats
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
    stats = StepStats(staleness_mean=0.5, staleness_max=1, staleness=[0, 1], **{**body, **fields})
    return StepEvent(source="learner", role="learner", stats=stats)


def test_an_event_decodes_to_its_type_and_a_step_to_its_stats():
    kind, ev = decode(encode(step(clipfrac=0.25, behaviour_kl_by_staleness={0: 0.01, 2: 0.03})))
    assert kind == "event" and isinstance(ev, StepEvent) and ev.type == "step"
    assert ev.version == 3 and ev.stats.clipfrac == 0.25 and ev.stats.accuracy is None
    assert ev.stats.behaviour_kl_by_staleness == {0: 0.01, 2: 0.03}  # int keys, as declared
    record = ev.record(t=1.5)
    # steps.jsonl: a stat left unmeasured is not in the line; accuracy always is; no per-sequence list
    assert "entropy" not in record and record["accuracy"] is None and "kind" not in record
    assert "staleness" not in record and record["staleness_max"] == 1 and record["t"] == 1.5
    assert record["type"] == "step" and record["source"] == "learner" and record["clipfrac"] == 0.25
    expected = {"ready", "error", "step", "done", "version", "broadcast", "checkpoint_part", "learner_final"}
    assert set(EVENTS) >= expected


def test_a_command_decodes_to_its_type():
    kind, command = decode(encode(CheckpointCommand(dir="/ckpt", version=4, roles=["buffer"], id="buffer@4")))
    assert kind == "control" and isinstance(command, CheckpointCommand) and command.command == "checkpoint"
    assert (command.dir, command.version, command.roles, command.id) == ("/ckpt", 4, ["buffer"], "buffer@4")
    assert isinstance(decode(encode(StopCommand()))[1], StopCommand)
    assert set(COMMANDS) == {"stop", "go", "release_weights", "requeue", "checkpoint", "checkpoint_committed"}


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
    decoded = decode(encode(ev))[1]
    assert decoded == ev and decoded.ready_at is None


def test_each_role_has_its_final_report_type():
    from asyncrl.roles import ROLE_NAMES
    from asyncrl.wire.messages import FINALS, LearnerFinal

    assert set(FINALS) == set(ROLE_NAMES) and all(cls.final for cls in FINALS.values())
    ev = LearnerFinal(source="learner", role="learner", version=4, trained=12, latency_s={"p50": 0.5})
    _, back = decode(encode(ev))
    assert isinstance(back, LearnerFinal) and back.type == "learner_final" and back == ev
    with pytest.raises(WireError) as err:  # a count of the wrong type
        decode(encode_map("event", {"type": "learner_final", "version": 4, "trained": "twelve"}))
    assert err.value.reason == "bad_fields"
