import dataclasses
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
    back = body.group
    assert back.group_id == g.group_id and back.policy_version == 7
    for a, b in zip(g.samples, back.samples):
        assert a.uid == b.uid and a.reward == b.reward
        assert b.response_ids.dtype == np.int32 and np.array_equal(a.response_ids, b.response_ids)
        assert b.logprobs.dtype == np.float32 and np.array_equal(a.logprobs, b.logprobs)
    assert np.array_equal(back.prompt_ids, g.prompt_ids)


def test_arrays_travel_as_raw_bytes_not_lists():
    frame = wire.encode_map("event", {"x": np.arange(1000, dtype=np.float32)})
    raw = msgpack.unpackb(frame)
    assert raw["x"]["data"] == np.arange(1000, dtype=np.float32).tobytes()
    assert raw["x"]["dtype"] == "<f4" and raw["x"]["shape"] == [1000]
    assert raw["schema"] == wire.SCHEMA_VERSION


def test_batch_round_trip():
    groups = [make_group(f"g{i}", rewards=[1.0] * 4) for i in range(3)]
    kind, body = wire.decode(wire.encode_map("batch", {"groups": [wire.group_to_dict(g) for g in groups]}))
    assert kind == "batch" and [g.group_id for g in body.groups] == ["g0", "g1", "g2"]


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
    frame = wire.encode_map("event", {"blob": b"x" * 2000})
    with pytest.raises(wire.WireError) as err:
        wire.decode(frame, max_bytes=1000)
    assert err.value.reason == "oversized"


def test_mismatched_lengths_and_non_numeric_dtypes_are_rejected():
    d = wire.group_to_dict(make_group())
    d["samples"][0]["logprobs"] = np.zeros(5, dtype=np.float32)
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode_map("group", {"group": d}))
    bad_array = {"__nd__": True, "dtype": "O", "shape": [1], "data": b"\x00" * 8}
    with pytest.raises(wire.WireError) as err:
        wire.decode(
            msgpack.packb({"schema": wire.SCHEMA_VERSION, "kind": "weights", "policy_version": 1, "x": bad_array})
        )
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
    assert wire.decode(frame)[0] == "group"  # whole, it decodes; any shorter, it is refused as malformed
    with pytest.raises(wire.WireError) as refused:
        wire.decode(frame[: max(0, len(frame) - cut)])
    assert refused.value.reason == "malformed", refused.value


# --- fuzzing: oversized, wrongly typed, wrong-schema frames and non-finite numbers -------------

MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
GROUP_FIELDS = [f.name for f in dataclasses.fields(wire.Group)]
SAMPLE_FIELDS = [f.name for f in dataclasses.fields(wire.Sample)]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048), st.integers(16, 2048))
def test_frames_over_the_limit_are_refused_whatever_they_hold(frame, limit):
    frame = frame if len(frame) % 2 else wire.encode_map("event", {"pad": frame})  # garbage and valid alike
    try:
        wire.decode(frame, max_bytes=limit)
    except wire.WireError as e:
        assert (e.reason == "oversized") == (len(frame) > limit)
    else:
        assert len(frame) <= limit


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(GROUP_FIELDS), st.sampled_from(SAMPLE_FIELDS), st.booleans(), MSGPACK_VALUES)
def test_wrongly_typed_fields_are_rejected_or_decode_to_well_typed_records(group_field, sample_field, in_sample, value):
    d = wire.group_to_dict(make_group(rewards=[1.0, 0.0, 1.0, 0.0]))
    if in_sample:
        d["samples"][1][sample_field] = value
    else:
        d[group_field] = value
    try:
        _kind, body = wire.decode(wire.encode_map("group", {"group": d}))
    except wire.WireError:
        return
    g = body.group  # accepted: then every field has the type the schema says
    assert all(
        isinstance(getattr(g, f), str) for f in ("group_id", "prompt_uid", "task", "prompt", "answer", "generator")
    )
    assert isinstance(g.policy_version, int) and isinstance(g.meta, dict) and isinstance(g.samples, list)
    for s in g.samples:
        assert isinstance(s.uid, str) and isinstance(s.text, str) and isinstance(s.finish_reason, str)
        assert s.reward is None or math.isfinite(s.reward)


@settings(max_examples=100, deadline=None)
@given(st.integers(-5, 5), st.text(max_size=12) | st.integers(-(2**63), 2**63 - 1) | st.none())
def test_wrong_schema_or_kind_is_rejected(schema, kind):
    frame = msgpack.packb({"schema": schema, "kind": kind, "group": {}})
    try:
        wire.decode(frame)
    except wire.WireError as e:
        assert e.reason in ("bad_schema", "bad_kind", "bad_fields")
        assert schema == wire.SCHEMA_VERSION or e.reason == "bad_schema"


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["logprobs", "reward", "token_rewards"]),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.integers(0, 3),
    st.integers(0, 2),
)
def test_nan_and_inf_anywhere_in_a_sample_are_rejected(where, bad, index, token):
    g = make_group(rewards=[1.0, 0.0, 1.0, 0.0])
    s = g.samples[index]
    if where == "reward":
        s.reward = bad
    else:
        values = np.zeros(3, dtype=np.float32)
        values[token] = bad
        setattr(s, where, values)
    with pytest.raises(wire.WireError) as err:
        wire.decode(wire.encode_group(g))
    assert err.value.reason == ("nonfinite_logprobs" if where == "logprobs" else "nonfinite_reward")


@pytest.mark.parametrize("kind", ["event", "group", "batch"])
def test_deeply_nested_messages_are_rejected_not_raised(kind):
    nested: list = []
    for _ in range(1000):  # msgpack allows 1024 levels; Python's recursion limit is lower
        nested = [nested]
    frame = msgpack.packb({"schema": wire.SCHEMA_VERSION, "kind": kind, "x": nested, "groups": [], "group": {}})
    with pytest.raises(wire.WireError):
        wire.decode(frame)


def test_arrays_are_restored_in_any_message_not_only_groups():
    frame = wire.encode_map(
        "weights", {"policy_version": 1, "logprobs": np.ones((2, 3), np.float32), "meta": [{"a": np.arange(2)}]}
    )
    kind, body = wire.decode(frame)
    assert body.extra["logprobs"].shape == (2, 3) and body.extra["logprobs"].dtype == np.float32
    assert body.extra["meta"][0]["a"].tolist() == [0, 1]
