"""The ``environment`` reward hands on each episode's ``env_reward``, and leaves an episode whose
environment failed (or a sample no environment played) unscored with the reason, never a 0."""

import asyncio

import numpy as np

from asyncrl.rewards.base import score_with
from asyncrl.rewards.config import RewardSpec
from asyncrl.rewards.registry import build_reward
from asyncrl.rewards.unscored import Unscored
from asyncrl.wire.schema import Episode
from tests.factories import make_group


def episode(**fields) -> Episode:
    return Episode("e/0", np.ones(3, np.uint8), **fields)


def test_each_episode_gets_its_environments_reward_or_is_unscored_with_the_reason():
    reward = build_reward(RewardSpec(kind="environment"))
    group = make_group("e", n=4)
    group.samples[0].episode = episode(env_reward=0.7)
    group.samples[1].episode = episode(env_error="environment_timeout: its step took longer than 30 s")
    group.samples[3].episode = episode()  # an agent program that ended without posting a reward
    results = asyncio.run(reward.score(group))
    assert results[0] == 0.7
    assert results[1] == Unscored("environment_timeout", "its step took longer than 30 s")
    assert results[2].reason == "no_environment"
    assert results[3].reason == "no_reward_posted"


def test_unbounded_rewards_combine_and_an_unscored_episode_unscores_its_group():
    reward = build_reward(RewardSpec(kind="environment"))
    group = make_group("e", n=2)
    group.samples[0].episode, group.samples[1].episode = episode(env_reward=5.0), episode(env_reward=-2.0)  # no range
    asyncio.run(score_with(group, [(reward, 1.0)]))
    assert [s.reward for s in group.samples] == [5.0, -2.0]
    failed = make_group("f", n=2)
    failed.samples[0].episode = episode(env_reward=1.0)
    failed.samples[1].episode = episode(env_error="environment_failed: step raised KeyError: 'x'")
    asyncio.run(score_with(failed, [(reward, 1.0)]))
    assert failed.unscored_reason.startswith("reward_failed: environment: environment_failed")


def test_step_rewards_become_per_token_rewards_on_the_turns_that_earned_them():
    reward = build_reward(RewardSpec(kind="environment"))
    group = make_group("e", n=2, length=6)
    group.samples[0].episode = Episode("e/0", np.ones(6, np.uint8), env_reward=0.5, step_rewards=[[1, -0.5], [5, 1.0]])
    group.samples[1].episode = Episode("e/1", np.ones(6, np.uint8), env_reward=2.0, step_rewards=[[1, 1.0]])  # no sum
    asyncio.run(score_with(group, [(reward, 1.0)]))
    first, second = group.samples
    assert first.reward == 0.5 and first.token_rewards.tolist() == [0.0, -0.5, 0.0, 0.0, 0.0, 1.0]
    assert second.reward == 2.0 and second.token_rewards is None  # they did not add up: the episode's reward alone
