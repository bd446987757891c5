"""Each group's advantages from its samples' rewards, as ``algorithm`` says: the trainer's first stage.

``shaped_rewards`` adds the overlong penalty (``algorithm.truncation.mode: penalise``);
``group_advantages`` applies ``algorithm.adv_estimator`` (``asyncrl.learner.advantages``) group by
group, or over the batch for the estimators that need it; ``weighted_advantages`` scales each
group's row by its importance weight. One (n_g,) array per group throughout. The critic's
per-token advantages (``gae``) are ``asyncrl.learner.critic``'s.
"""

from __future__ import annotations

import numpy as np

from asyncrl.learner.advantages import ADV_ESTIMATORS, BATCH_ESTIMATORS, remax_advantages
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.truncation import overlong_penalty
from asyncrl.wire.schema import Group


def shaped_rewards(algo: AlgorithmConfig, groups: list[Group]) -> list[np.ndarray]:
    """Each group's rewards, one (n_g,) row per group, with the overlong penalty added under
    ``algorithm.truncation.mode: penalise`` (``asyncrl.learner.truncation``)."""
    for group in groups:
        if not group.scored:
            raise ValueError(f"group {group.group_id}: every sample needs a reward before training")
    rewards = [np.asarray([s.reward for s in g.samples], dtype=np.float32) for g in groups]
    truncation = algo.truncation
    if truncation.mode == "penalise":
        l_max, l_cache = truncation.interval(truncation.max_tokens)
        rewards = [
            r + overlong_penalty([len(s.response_ids) for s in g.samples], l_max, l_cache, truncation.penalty)
            for r, g in zip(rewards, groups)
        ]
    return rewards


def group_advantages(
    algo: AlgorithmConfig, groups: list[Group], rewards: list[np.ndarray] | None = None
) -> list[np.ndarray]:
    """Advantages of each group's samples by ``algorithm.adv_estimator``, one (n_g,) array per group.

    ``rewards``: per-group reward rows to use instead of ``shaped_rewards`` (a KL-penalised
    reward). Groups of equal size are stacked (G, n); group-local estimators also take ragged
    groups.
    """
    if rewards is None:
        rewards = shaped_rewards(algo, groups)
    if algo.adv_estimator == "remax":  # baseline: the reward of each prompt's greedy answer
        missing = [g.group_id for g in groups if "greedy_reward" not in g.meta]
        if missing:
            raise ValueError(f"groups {missing[:3]} have no meta['greedy_reward'] (generator.greedy_baseline)")
        greedy = [float(g.meta["greedy_reward"]) for g in groups]
        return [remax_advantages(r[None], np.array([b], dtype=np.float32))[0] for r, b in zip(rewards, greedy)]
    # gae's advantages are per token and need the critic (the training step); here, for replay
    # priorities, it stands in with the group-centred rewards.
    estimator = ADV_ESTIMATORS["dr_grpo" if algo.adv_estimator == "gae" else algo.adv_estimator]
    sizes = {len(r) for r in rewards}
    if len(sizes) == 1:
        return list(estimator(np.stack(rewards)))  # (G, n) -> G rows
    if algo.adv_estimator in BATCH_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator '{algo.adv_estimator}' needs groups of one size, got sizes {sorted(sizes)}"
        )
    return [estimator(r[None])[0] for r in rewards]


def weighted_advantages(
    algo: AlgorithmConfig, groups: list[Group], weights=None, rewards: list[np.ndarray] | None = None
) -> list[np.ndarray]:
    """Advantages, each group's row scaled by its weight (a replay buffer's importance
    weight w_g); ``None``: unweighted.

    Scaling group g's advantages by w_g >= 0 is exactly weighting each of its tokens' policy
    loss by w_g: every policy loss is positively homogeneous in A,
    max(-w·A·ratio, -w·A·clip(ratio)) = w·max(-A·ratio, -A·clip(ratio)) (and the dual clip's
    min, GSPO's and CISPO's products alike), and the correction weights and the aggregation
    are untouched; so no loss function needs a weight argument. The KL and entropy terms
    are not scaled: they regularise the policy, not the sampled estimate.
    """
    rows = group_advantages(algo, groups, rewards)
    if weights is None:
        return rows
    w = np.asarray(weights, dtype=np.float32).reshape(-1)
    if w.size != len(groups):
        raise ValueError(f"weights has {w.size} entries, must have one per group ({len(groups)})")
    if not (np.isfinite(w).all() and (w >= 0).all()):
        raise ValueError(f"weights ({w.tolist()}) must be finite and >= 0")
    return [row * wg for row, wg in zip(rows, w)]
