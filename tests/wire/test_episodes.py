"""Schema 3: a sample may be a multi-turn episode, its ``episode`` holding the mask of the
policy's tokens. It travels whole, a malformed one is rejected by name, a single-turn answer pays
one key for it, and a stored schema-2 frame still restores."""

import dataclasses

import msgpack
import numpy as np
import pytest

from asyncrl import wire
from asyncrl.wire.codec import upgrade
from asyncrl.wire.schema import Episode, policy_tokens
from tests.factories import make_group

MASK = np.array([1, 1, 1, 0, 0, 1, 1], dtype=np.uint8)


def episode_group(group_id: str = "e") -> wire.Group:
    """Two samples, each a model turn (3 tokens), an observation (2 tokens) and a second turn (2)."""
    group = make_group(group_id, n=2, length=7)
    for index, sample in enumerate(group.samples):
        sample.logprobs = np.where(MASK == 1, -0.5, 0.0).astype(np.float32)
        sample.episode = Episode(
            f"{group_id}/{index}",
            MASK,
            turns=2,
            tool_calls=1,
            tool_errors=index,
            env_reward=0.5,
            step_rewards=[[6, 0.5]],
        )
    return group


def test_an_episode_travels_with_its_mask_and_counters():
    _, msg = wire.decode(wire.encode_group(episode_group()))
    sample = msg.group.samples[1]
    e = sample.episode
    assert e.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1] and e.loss_mask.dtype == np.uint8
    assert (e.id, e.turns, e.tool_calls, e.tool_errors, e.env_reward) == ("e/1", 2, 1, 1, 0.5)
    assert e.step_rewards == [[6, 0.5]] and policy_tokens(sample) == 5


def test_a_single_turn_answer_pays_one_key_for_it():
    raw = msgpack.unpackb(wire.encode_group(make_group("s")), raw=False)
    assert raw["group"]["samples"][0]["episode"] is None
    _, msg = wire.decode(wire.encode_group(make_group("s")))
    sample = msg.group.samples[0]
    assert sample.episode is None and policy_tokens(sample) == len(sample.response_ids)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"loss_mask": np.ones(6, np.uint8)}, "shaped like response_ids"),
        ({"loss_mask": np.ones(7, np.float32)}, "integer array"),
        ({"loss_mask": np.full(7, 2, np.uint8)}, "only 0 and 1"),
        ({"logprobs": np.full(7, -0.5, np.float32)}, "no logprob"),  # observation tokens with logprobs
        ({"turns": -1}, "turns"),
        ({"id": 3}, "episode.id"),
        ({"env_reward": float("nan")}, "env_reward"),
        ({"step_rewards": [[7, 1.0]]}, "step_rewards"),  # past the last token
        ({"step_rewards": [[0, float("inf")]]}, "step_rewards"),
        ({"part": -1}, "part"),
    ],
)
def test_a_malformed_episode_is_rejected_naming_the_field(change, words):
    group = episode_group()
    sample = group.samples[0]
    if "logprobs" in change:
        sample.logprobs = change.pop("logprobs")
    sample.episode = dataclasses.replace(sample.episode, **change)
    with pytest.raises(wire.WireError, match=words):
        wire.validate_group(group)
    with pytest.raises(wire.WireError, match=words):  # and so on the wire
        wire.decode(wire.encode_group(group))


def schema_2_frame() -> bytes:
    body = msgpack.unpackb(wire.encode_group(make_group("old", rewards=[1.0, 0.0, 1.0, 0.0])), raw=False)
    for sample in body["group"]["samples"]:
        sample.pop("episode")
    body["schema"] = 2
    return msgpack.packb(body, use_bin_type=True)


def test_a_schema_2_frame_is_refused_on_the_wire_saying_what_changed():
    with pytest.raises(wire.WireError, match=r"schema \(2\) must be 3 \(schema 2 knew single-turn answers only") as e:
        wire.decode(schema_2_frame())
    assert e.value.reason == "bad_schema"


def test_a_stored_schema_2_frame_is_restamped_and_restores():
    _, msg = wire.decode(upgrade(schema_2_frame()))
    assert [s.reward for s in msg.group.samples] == [1.0, 0.0, 1.0, 0.0]
    assert all(s.episode is None for s in msg.group.samples)
