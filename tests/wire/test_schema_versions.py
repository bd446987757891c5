"""Schema 2 declares the group fields schema 1 kept in ``meta``: the sockets refuse a schema-1 frame
with a message that says what changed, a stored one (a buffer snapshot's groups) is upgraded."""

import dataclasses

import msgpack
import pytest

from asyncrl import wire
from asyncrl.wire.codec import upgrade
from asyncrl.wire.schema import MOVED_FROM_META, SCHEMA_VERSION
from tests.factories import make_group


def schema_1_frame(kind: str = "group") -> bytes:
    """A frame as schema 1 wrote it: the group's declared fields in its meta."""
    body = msgpack.unpackb(wire.encode_group(make_group("old", rewards=[1.0, 0.0, 1.0, 0.0])), raw=False)
    group = body["group"]
    meta = {"sampled_at": 12.5, "greedy_text": "7", "greedy_reward": 1.0, "rewards": "exact_match"}
    for name in MOVED_FROM_META:
        group.pop(name)
    group["meta"] = meta
    body["schema"] = 1
    if kind == "groups":
        body = {"schema": 1, "kind": "groups", "groups": [group]}
    return msgpack.packb(body, use_bin_type=True)


def test_the_group_fields_travel_declared():
    g = dataclasses.replace(make_group("g"), sampled_at=3.5, greedy_text="4", unscored_reason="reward_failed: x: y")
    (_, msg) = wire.decode(wire.encode_group(g))
    assert (msg.group.sampled_at, msg.group.greedy_text, msg.group.unscored_reason) == (3.5, "4", "reward_failed: x: y")
    assert msg.group.greedy_reward is None and msg.group.meta == {}
    assert SCHEMA_VERSION == 3


def test_a_schema_1_frame_is_refused_on_the_wire_saying_what_changed():
    with pytest.raises(
        wire.WireError, match=r"schema \(1\) must be 3 \(schema 1 carried .*sampled_at.* in its meta"
    ) as e:
        wire.decode(schema_1_frame())
    assert e.value.reason == "bad_schema"


@pytest.mark.parametrize("kind", ["group", "groups"])
def test_a_stored_schema_1_frame_is_upgraded_to_the_declared_fields(kind):
    _, msg = wire.decode(upgrade(schema_1_frame(kind)))
    group = msg.group if kind == "group" else msg.groups[0]
    assert (group.sampled_at, group.greedy_text, group.greedy_reward) == (12.5, "7", 1.0)
    assert group.meta == {"rewards": "exact_match"}  # free-form notes stay
    current = wire.encode_group(make_group("new"))
    assert upgrade(current) == current and upgrade(b"\xc1") == b"\xc1"  # as is: decode judges them


def test_a_declared_group_field_of_the_wrong_type_is_rejected():
    frame = msgpack.unpackb(wire.encode_group(make_group("g")), raw=False)
    frame["group"]["unscored_reason"] = 3
    with pytest.raises(wire.WireError) as e:
        wire.decode(msgpack.packb(frame, use_bin_type=True))
    assert e.value.reason == "bad_fields"
    with pytest.raises(wire.WireError, match="greedy_text"):
        wire.validate_group(dataclasses.replace(make_group("g"), greedy_text=7))


def test_a_buffer_snapshot_written_under_schema_1_restores(tmp_path):
    from asyncrl.buffer.config import BufferConfig
    from asyncrl.buffer.replay import ReplayBuffer

    cfg = BufferConfig(capacity_samples=32, seed=1)
    buf = ReplayBuffer.from_config(cfg)
    for i in range(3):
        buf.insert(dataclasses.replace(make_group(f"g{i}", rewards=[1.0, 0.0, 0.0, 1.0]), sampled_at=10.0 + i))
    buf.snapshot(tmp_path / "snap")
    frames = msgpack.unpackb((tmp_path / "snap" / "groups.bin").read_bytes(), raw=False)
    old = []  # as schema 1 wrote them: the declared fields in meta
    for frame in frames:
        body = msgpack.unpackb(frame, raw=False)
        body["schema"], group = 1, body["group"]
        group["meta"] = {name: group.pop(name) for name in MOVED_FROM_META if group[name] is not None}
        old.append(msgpack.packb(body, use_bin_type=True))
    (tmp_path / "snap" / "groups.bin").write_bytes(msgpack.packb(old, use_bin_type=True))
    restored = ReplayBuffer.from_config(cfg)
    restored.restore(tmp_path / "snap")
    assert restored.reconcile() == buf.reconcile()
    assert sorted(g.sampled_at for g in restored.sample(3).items) == [10.0, 11.0, 12.0]
