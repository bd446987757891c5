"""Priority functions: how much a group is worth training on, computed when it arrives.

GRPO learns only from groups whose answers score differently: a group whose n rewards are all
equal has advantages 0 and contributes no gradient. So the natural priority of a group is a
measure of the spread of its rewards, computed from the rewards alone (never from token counts,
so long answers are not favoured or starved). Each function maps a (G, n) reward matrix to (G,)
priorities >= 0:

- ``reward_variance``:     p = mean_i (r_i - mean(r))²
- ``learnability``:        p = r̄ (1 - r̄), r̄ = mean(r) clipped to [0, 1]  (success rate × failure rate;
                           equals the variance for 0/1 rewards, and ignores spread inside [0, 1] otherwise)
- ``mean_abs_advantage``:  p = mean_i |A_i|, A = GRPO advantages (r - mean) / (std + 1e-6), the
                           quantity the learner reports after a step, so its updates share units
- ``uniform``:             p = 1

``GroupPriority`` adds recency, p · decay^(learner_version - policy_version). The floor that
keeps every group reachable is applied by the sampler, the one owner of the priority structure.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def reward_variance(rewards: np.ndarray) -> np.ndarray:
    """(G, n) rewards -> (G,) population variances."""
    return np.asarray(rewards, dtype=np.float64).var(axis=1)


def learnability(rewards: np.ndarray) -> np.ndarray:
    """(G, n) rewards -> (G,) r̄(1 - r̄), with r̄ the mean reward clipped to [0, 1]."""
    p = np.clip(np.asarray(rewards, dtype=np.float64).mean(axis=1), 0.0, 1.0)
    return p * (1.0 - p)


def mean_abs_advantage(rewards: np.ndarray) -> np.ndarray:
    """(G, n) rewards -> (G,) mean |GRPO advantage| (std-scaled, as the trainer's default).

    The formula of ``asyncrl.learner.advantages.grpo_advantages``, in numpy here so that the
    buffer process never imports torch; a test checks that the two agree.
    """
    r = np.asarray(rewards, dtype=np.float64)
    centred = r - r.mean(axis=1, keepdims=True)  # (G, n)
    return (np.abs(centred) / (r.std(axis=1, keepdims=True) + 1e-6)).mean(axis=1)


def uniform(rewards: np.ndarray) -> np.ndarray:
    """(G, n) rewards -> (G,) ones."""
    return np.ones(len(rewards))


PRIORITIES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "reward_variance": reward_variance,
    "learnability": learnability,
    "mean_abs_advantage": mean_abs_advantage,
    "uniform": uniform,
}
"""Priority functions by name, for ``BufferConfig.priority``."""


class GroupPriority:
    """A named priority function with recency decay.

    priority = f(rewards) · decay^(learner_version - policy_version)

    >>> GroupPriority("reward_variance")([[1.0, 0.0, 1.0, 0.0]], [0], learner_version=0).tolist()
    [0.25]
    """

    def __init__(self, name: str = "reward_variance", recency_decay: float = 1.0):
        if name not in PRIORITIES:
            raise ValueError(f"priority ({name!r}) must be one of {sorted(PRIORITIES)}")
        if not 0 < recency_decay <= 1:
            raise ValueError(f"recency_decay ({recency_decay}) must be in (0, 1]")
        self.name = name
        self.fn = PRIORITIES[name]
        self.recency_decay = recency_decay

    def __call__(self, rewards, policy_versions, learner_version: int) -> np.ndarray:
        """(G, n) rewards (or a list of G reward rows of any lengths) -> (G,) priorities."""
        if isinstance(rewards, np.ndarray) and rewards.ndim == 2:
            p = self.fn(rewards)
        else:  # groups of different sizes: one row at a time
            p = np.array([self.fn(np.asarray(row, dtype=np.float64)[None, :])[0] for row in rewards])
        return p * self.decay(learner_version - np.asarray(policy_versions))

    def decay(self, age_versions) -> np.ndarray:
        """decay^age for ages in versions (negative ages count as 0)."""
        age = np.maximum(np.asarray(age_versions, dtype=np.float64), 0.0)
        return np.power(self.recency_decay, age)
