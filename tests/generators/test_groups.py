"""Completions -> the wire's group: an episode's parts get their own uids and keep their episode's
id, and a sample whose context is not the group's prompt carries its own."""

import numpy as np

from asyncrl.generators.completion import Completion
from asyncrl.generators.groups import build_groups

ROW = {"group_id": "g", "prompt_uid": "p", "task": "t", "text": "q", "answer": "a"}


def completion(prompt, episode=None, part=0) -> Completion:
    ids = np.array([7, 8], np.int32)
    return Completion(
        np.array(prompt, np.int32), ids, np.full(2, -0.5, np.float32), "x", "stop",
        loss_mask=np.ones(2, np.uint8), episode_index=episode, part=part,
    )  # fmt: skip


def test_parts_and_openings_keep_their_own_context():
    comps = [completion([1, 2], 0), completion([1, 2, 9], 0, part=1), completion([1, 2], 1), completion([1, 3], 2)]
    (group,) = build_groups([ROW], [comps], version=0, generator="gen-0", rollout_s=0.1)
    assert [s.uid for s in group.samples] == ["g/0", "g/0.1", "g/1", "g/2"]
    assert [s.episode.id for s in group.samples] == ["g/0", "g/0", "g/1", "g/2"]
    assert group.prompt_ids.tolist() == [1, 2]
    own = [None if s.episode.prompt_ids is None else s.episode.prompt_ids.tolist() for s in group.samples]
    assert own == [None, [1, 2, 9], None, [1, 3]]
