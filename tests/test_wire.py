import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import wire
from tests.factories import make_group


def test_group_round_trip_keeps_arrays_and_fields():
    g = make_group(rewards=[1.0, 0.0, 1.0, 0.0], version=7)
    kind, body = wire.decode(wire.encode_group(g))
    assert kind == "group"
    back = body["group"]
    assert back.group_id == g.group_id and back.policy_version == 7
    for a, b in zip(g.samples, back.samples):
        assert a.uid == b.uid and a.reward == b.reward
        assert b.response_ids.dtype == np.int32 and np.array_equal(a.response_ids, b.response_ids)
        assert b.logprobs.dtype == np.float32 and np.array_equal(a.logprobs, b.logprobs)
    assert np.array_equal(back.prompt_ids, g.prompt_ids)


def test_arrays_travel_as_raw_bytes_not_lists():
    frame = wire.encode("event", {"x": np.arange(1000, dtype=np.float32)})
    raw = msgpack.unpackb(frame)
    assert raw["x"]["data"] == np.arange(1000, dtype=np.float32).tobytes()
    assert raw["x"]["dtype"] == "<f4" and raw["x"]["shape"] == [1000]
    assert raw["schema"] == wire.SCHEMA_VERSION


def test_batch_round_trip():
    groups = [make_group(f"g{i}", rewards=[1.0] * 4) for i in range(3)]
    kind, body = wire.decode(wire.encode("batch", {"groups": [wire.group_to_dict(g) for g in groups]}))
    assert kind == "batch" and [g.group_id for g in body["groups"]] == ["g0", "g1", "g2"]


@pytest.mark.parametrize(
    "frame, reason",
    [
        (b"\xc1garbage", "malformed"),
        (msgpack.packb([1, 2, 3]), "malformed"),
        (msgpack.packb({"schema": 99, "kind": "group"}), "bad_schema"),
        (msgpack.packb({"kind": "group"}), "bad_schema"),
        (msgpack.packb({"schema": wire.SCHEMA_VERSION, "kind": "nope"}), "bad_kind"),
        (msgpack.packb({"schema": wire.SCHEMA_VERSION, "kind": "group", "group": 5}), "bad_fields"),
    ],
)
def test_bad_frames_are_rejected_with_a_reason(frame, reason):
    with pytest.raises(wire.WireError) as err:
        wire.decode(frame)
    assert err.value.reason == reason


def test_nan_logprobs_are_rejected():
    g = make_group()
    g.samples[1].logprobs = np.array([-0.1, math.nan, -0.2], dtype=np.float32)
    with pytest.raises(wire.WireError) as err:
        wire.decode(wire.encode_group(g))
    assert err.value.reason == "nonfinite_logprobs"


def test_oversized_frames_are_rejected_before_decoding():
    frame = wire.encode("event", {"blob": b"x" * 2000})
    with pytest.raises(wire.WireError) as err:
        wire.decode(frame, max_bytes=1000)
    assert err.value.reason == "oversized"


def test_mismatched_lengths_and_non_numeric_dtypes_are_rejected():
    d = wire.group_to_dict(make_group())
    d["samples"][0]["logprobs"] = np.zeros(5, dtype=np.float32)
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode("group", {"group": d}))
    bad_array = {"__nd__": True, "dtype": "O", "shape": [1], "data": b"\x00" * 8}
    with pytest.raises(wire.WireError) as err:
        wire.decode(msgpack.packb({"schema": wire.SCHEMA_VERSION, "kind": "event", "x": bad_array}))
    assert err.value.reason == "bad_array"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decode_never_raises_anything_but_wire_error(frame):
    try:
        wire.decode(frame)
    except wire.WireError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3), st.integers(1, 200))
def test_truncated_frames_are_rejected(n, cut):
    frame = wire.encode_group(make_group(n=n + 1))
    try:
        wire.decode(frame[: max(0, len(frame) - cut)])
    except wire.WireError:
        pass
