"""The ``environment`` reward: what a multi-turn episode's environment gave it.

An episode's ``Sample.episode.env_reward`` is the sum of its environment's step rewards
(``asyncrl.generators.rollouts``). This reward hands it on, so that it combines with the run's
other rewards (``reward = Σ w_i r_i``: e.g. the environment's success and an exact match of the
final answer). An episode whose environment failed (``env_error``: it raised or timed
out) is unscored with that reason, never a 0; so is a sample no environment played. The steps'
rewards go on as per-token rewards, each on the last token of the turn that earned it.
"""

from __future__ import annotations

import numpy as np

from asyncrl.rewards.base import RewardResult
from asyncrl.rewards.unscored import Unscored
from asyncrl.wire.schema import Group


def step_rewards(sample) -> np.ndarray | float:
    """The episode's step rewards as per-token rewards (each on the last token of the turn that
    earned it; their sum is the episode's ``env_reward``), so that the estimators that credit
    tokens (GAE, REINFORCE++) see which turn earned what; its ``env_reward`` alone when they do
    not add up to it."""
    e = sample.episode
    tokens = np.zeros(len(sample.response_ids), dtype=np.float32)
    for index, reward in e.step_rewards:
        tokens[index] += reward
    if not np.isclose(float(tokens.sum()), e.env_reward, atol=1e-4):
        return float(e.env_reward)
    return tokens


class EnvironmentReward:
    """Each episode's ``env_reward``; unscored where its environment failed or none played it."""

    per_sample = True

    def __init__(self, name: str = "environment"):
        self.name = name

    async def score(self, group: Group) -> list[RewardResult]:
        results: list[RewardResult] = []
        for s in group.samples:
            e = s.episode
            if e is not None and e.env_error is not None:
                reason, _, detail = e.env_error.partition(": ")
                results.append(Unscored(reason or "environment_failed", detail))
            elif e is None:
                results.append(Unscored("no_environment", "the sample is not an episode of an environment"))
            elif e.env_reward is None:  # an agent program that ended without posting one
                results.append(Unscored("no_reward_posted", "its agent program posted no reward"))
            else:
                results.append(step_rewards(s) if e.step_rewards else float(e.env_reward))
        return results

    async def close(self) -> None:
        pass
