"""Schema 3: a sample may be a multi-turn episode, its ``loss_mask`` marking the policy's tokens.
It travels whole, a malformed one is rejected by name, and a stored schema-2 frame still restores."""

import dataclasses

import msgpack
import numpy as np
import pytest

from asyncrl import wire
from asyncrl.wire.codec import upgrade
from asyncrl.wire.schema import policy_tokens
from tests.factories import make_group


def episode_group(group_id: str = "e") -> wire.Group:
    """Two samples, each a model turn (3 tokens), an observation (2 tokens) and a second turn (2)."""
    group = make_group(group_id, n=2, length=7)
    mask = np.array([1, 1, 1, 0, 0, 1, 1], dtype=np.uint8)
    for index, sample in enumerate(group.samples):
        sample.loss_mask = mask
        sample.logprobs = np.where(mask == 1, -0.5, 0.0).astype(np.float32)
        sample.episode_id = f"{group_id}/{index}"
        sample.turns, sample.tool_calls, sample.tool_errors, sample.env_reward = 2, 1, index, 0.5
    return group


def test_an_episode_travels_with_its_mask_and_counters():
    _, msg = wire.decode(wire.encode_group(episode_group()))
    sample = msg.group.samples[1]
    assert sample.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1] and sample.loss_mask.dtype == np.uint8
    assert (sample.episode_id, sample.turns, sample.tool_calls, sample.tool_errors) == ("e/1", 2, 1, 1)
    assert sample.env_reward == 0.5 and policy_tokens(sample) == 5


def test_a_single_turn_answer_omits_them():
    _, msg = wire.decode(wire.encode_group(make_group("s")))
    sample = msg.group.samples[0]
    assert sample.loss_mask is None and sample.episode_id is None and (sample.turns, sample.tool_calls) == (1, 0)
    assert policy_tokens(sample) == len(sample.response_ids)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"loss_mask": np.ones(6, np.uint8)}, "shaped like response_ids"),
        ({"loss_mask": np.ones(7, np.float32)}, "integer array"),
        ({"loss_mask": np.full(7, 2, np.uint8)}, "only 0 and 1"),
        ({"logprobs": np.full(7, -0.5, np.float32)}, "no logprob"),  # an observation token with one
        ({"turns": -1}, "turns"),
        ({"episode_id": 3}, "episode_id"),
        ({"env_reward": float("nan")}, "env_reward"),
    ],
)
def test_a_malformed_episode_is_rejected_naming_the_field(change, words):
    group = episode_group()
    group.samples[0] = dataclasses.replace(group.samples[0], **change)
    with pytest.raises(wire.WireError, match=words):
        wire.validate_group(group)
    with pytest.raises(wire.WireError, match=words):  # and so on the wire
        wire.decode(wire.encode_group(group))


def schema_2_frame() -> bytes:
    body = msgpack.unpackb(wire.encode_group(make_group("old", rewards=[1.0, 0.0, 1.0, 0.0])), raw=False)
    for sample in body["group"]["samples"]:
        for name in ("loss_mask", "episode_id", "turns", "tool_calls", "tool_errors", "env_reward", "env_error"):
            sample.pop(name)
    body["schema"] = 2
    return msgpack.packb(body, use_bin_type=True)


def test_a_schema_2_frame_is_refused_on_the_wire_saying_what_changed():
    with pytest.raises(wire.WireError, match=r"schema \(2\) must be 3 \(schema 2 knew single-turn answers only") as e:
        wire.decode(schema_2_frame())
    assert e.value.reason == "bad_schema"


def test_a_stored_schema_2_frame_is_restamped_and_restores():
    _, msg = wire.decode(upgrade(schema_2_frame()))
    assert [s.reward for s in msg.group.samples] == [1.0, 0.0, 1.0, 0.0]
    assert all(s.loss_mask is None and s.turns == 1 for s in msg.group.samples)
