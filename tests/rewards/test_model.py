"""The reward model scores (prompt, answer) pairs in batches, the same as one at a time."""

import asyncio

import pytest

from asyncrl.rewards.base import score_with
from asyncrl.rewards.model import build_tiny_reward_model
from asyncrl.rewards.registry import RewardSpec, build_reward
from tests.factories import make_group


@pytest.mark.slow  # the first transformers model of a process: ~6 s of imports where no test loaded one before
def test_a_tiny_reward_model_scores_groups_batched(tmp_path):
    path = build_tiny_reward_model(tmp_path / "rm")
    spec = RewardSpec(kind="reward_model", name="rm", options={"path": str(path), "batch_size": 3})
    reward = build_reward(spec)
    group = make_group("g", n=5)
    for s, text in zip(group.samples, ["1", "22", "333", "4444", "55555"]):  # different lengths: padding matters
        s.text = text
    asyncio.run(score_with(group, [(reward, 1.0)]))
    assert group.scored
    one_by_one = [reward.score_texts([group.prompt + s.text])[0] for s in group.samples]
    assert [s.reward for s in group.samples] == pytest.approx(one_by_one, abs=1e-4)
    assert len(set(round(s.reward, 5) for s in group.samples)) > 1
