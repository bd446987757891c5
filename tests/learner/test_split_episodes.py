"""An episode split into parts (its agent edited its context, so a new sample started): each part
follows its own context in the learner's input, the episode counts once in its group's baseline,
and every part is trained with its episode's advantage, the outcome of its last part."""

import numpy as np

from asyncrl.learner.batch import collate
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.group_advantages import group_advantages
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import GroupMessage
from asyncrl.wire.schema import Episode, Group, Sample, episode_parts, validate_group

PROMPT = np.array([3, 4, 5], dtype=np.int32)
EDITED = np.array([3, 9, 9, 9], dtype=np.int32)  # the agent's summarised history


def part(uid: str, episode: str, k: int, reward: float, prompt=None, length: int = 2) -> Sample:
    ids = np.arange(20, 20 + length, dtype=np.int32)
    mask = np.ones(length, dtype=np.uint8)
    return Sample(
        uid, ids, np.full(length, -0.5, np.float32), "", "stop", reward=reward,
        episode=Episode(episode, mask, part=k, prompt_ids=prompt),
    )  # fmt: skip


def group() -> Group:
    samples = [
        part("g/0", "g/0", 0, reward=0.0),  # the first part scores nothing on its own: the outcome is the last part's
        part("g/0.1", "g/0", 1, reward=1.0, prompt=EDITED, length=3),
        part("g/1", "g/1", 0, reward=0.0),
        part("g/2", "g/2", 0, reward=1.0),
    ]
    return Group("g", "p", "t", "", "", PROMPT, 0, "gen-0", samples)


def test_parts_are_linked_to_their_episode():
    assert episode_parts(group()) == [0, 0, 1, 2]
    validate_group(group())


def test_a_split_episode_counts_once_with_its_last_parts_outcome():
    split = group_advantages(AlgorithmConfig(adv_estimator="grpo"), [group()])[0]
    # the same as three one-sample episodes of rewards 1, 0, 1
    whole = Group(
        "h",
        "p",
        "t",
        "",
        "",
        PROMPT,
        0,
        "gen-0",
        [part(f"h/{i}", f"h/{i}", 0, r) for i, r in enumerate([1.0, 0.0, 1.0])],
    )
    expected = group_advantages(AlgorithmConfig(adv_estimator="grpo"), [whole])[0]
    assert np.allclose(split, [expected[0], expected[0], expected[1], expected[2]])
    assert split[0] > 0 > split[2]


def test_a_later_part_follows_its_own_context():
    g = group()
    batch = collate([g], [[1.0, 1.0, -1.0, 1.0]], pad_id=0)
    assert batch.input_ids[0, :5].tolist() == PROMPT.tolist() + [20, 21]
    assert batch.input_ids[1, :7].tolist() == EDITED.tolist() + [20, 21, 22]
    assert batch.response_mask[1, len(EDITED) - 1 : len(EDITED) + 2].tolist() == [1.0, 1.0, 1.0]


def test_parts_cross_the_wire():
    out = decode(encode(GroupMessage(group=group())))[1].group
    assert out.samples[1].episode.part == 1
    assert out.samples[1].episode.prompt_ids.tolist() == EDITED.tolist()
    assert out.samples[0].episode.prompt_ids is None
