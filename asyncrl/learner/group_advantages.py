"""Each group's advantages from its samples' rewards, as ``algorithm`` says: the trainer's first stage.

``shaped_rewards`` adds the overlong penalty (``algorithm.truncation.mode: penalise``);
``group_advantages`` applies ``algorithm.adv_estimator`` (``asyncrl.learner.advantages``) group by
group, or over the batch for the estimators that need it, with the options ``algorithm`` sets
(``estimator_options``); ``weighted_advantages`` scales each group's row by its importance
weight. One (n_g,) array per group throughout. The critic's
per-token advantages (``gae``) are ``asyncrl.learner.critic``'s.

An episode split into several samples (``Episode.part``: an agent that edited its context)
counts once: its outcome is its last part's reward (the part that holds its final answer), the
estimator runs over the group's episodes with each episode's length the sum of its parts', and
every part is trained with its episode's advantage. Counting parts as answers would weigh an
episode by how often it edited its context. (verl's and AReaL's agent loops give each split
sample the trajectory's reward likewise; here the baseline is also taken over episodes.)
"""

from __future__ import annotations

import numpy as np

from asyncrl.learner.advantages import ADV_ESTIMATORS, BATCH_ESTIMATORS, remax_advantages
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.truncation import is_truncated, overlong_penalty
from asyncrl.wire.schema import Group, episode_parts


def shaped_rewards(algo: AlgorithmConfig, groups: list[Group]) -> list[np.ndarray]:
    """Each group's rewards, one (n_g,) row per group, with the overlong penalty added under
    ``algorithm.truncation.mode: penalise`` (``asyncrl.learner.truncation``)."""
    for group in groups:
        if not group.scored:
            raise ValueError(f"group {group.group_id}: every sample needs a reward before training")
    rewards = [episode_outcomes(g, np.asarray([s.reward for s in g.samples], dtype=np.float32)) for g in groups]
    truncation = algo.truncation
    if truncation.mode == "penalise":
        l_max, l_cache = truncation.interval(truncation.max_tokens)
        rewards = [
            r + overlong_penalty([len(s.response_ids) for s in g.samples], l_max, l_cache, truncation.penalty)
            for r, g in zip(rewards, groups)
        ]
    return rewards


def episode_outcomes(group: Group, row: np.ndarray) -> np.ndarray:
    """``row`` (one reward per sample) with each part of a split episode given its episode's
    outcome, the reward of its last part; unchanged when no episode is split."""
    parts = episode_parts(group)
    if parts is None:
        return row
    last = {episode: i for i, episode in enumerate(parts)}  # the last sample of each episode
    return np.asarray([row[last[e]] for e in parts], dtype=row.dtype)


def by_episode(group: Group, row: np.ndarray, reduce) -> np.ndarray:
    """One value per episode of ``group`` from ``row`` (one per sample): ``reduce`` over its parts."""
    parts = episode_parts(group)
    if parts is None:
        return row
    count = max(parts) + 1
    return np.asarray([reduce(row[[i for i, e in enumerate(parts) if e == k]]) for k in range(count)], dtype=row.dtype)


def _last(values: np.ndarray):
    return values[-1]


def to_samples(group: Group, row: np.ndarray) -> np.ndarray:
    """Each sample's value from ``row`` (one per episode): a part takes its episode's."""
    parts = episode_parts(group)
    return row if parts is None else row[np.asarray(parts)]


def loss_lengths(algo: AlgorithmConfig, groups: list[Group]) -> list[np.ndarray]:
    """Each sample's response tokens in the loss, one (n_g,) row per group: its response length,
    0 for a truncated sample under ``algorithm.truncation.mode: mask`` (out of the loss)."""
    rows = [np.asarray([len(s.response_ids) for s in g.samples], dtype=np.float64) for g in groups]
    if algo.truncation.mode == "mask":
        rows = [np.where(is_truncated(g), 0.0, row) for row, g in zip(rows, groups)]
    return rows


def estimator_options(algo: AlgorithmConfig) -> dict:
    """The keyword arguments ``algorithm`` gives every ``ADV_ESTIMATORS`` function (each takes
    the ones it uses): the std estimator, REINFORCE++'s whitening, pass@k's k."""
    return {
        "unbiased": algo.std_estimator == "unbiased",
        "whitening": algo.reinforce_pp_whitening,
        "k": algo.pass_k,
    }


def group_advantages(
    algo: AlgorithmConfig, groups: list[Group], rewards: list[np.ndarray] | None = None
) -> list[np.ndarray]:
    """Advantages of each group's samples by ``algorithm.adv_estimator``, one (n_g,) array per group.

    ``rewards``: per-group reward rows to use instead of ``shaped_rewards`` (a KL-penalised
    reward). Groups of equal size are stacked (G, n); group-local estimators also take ragged
    groups. The estimators that weigh samples by length (REINFORCE++'s token whitening, OPO's
    baseline) get ``loss_lengths``.
    """
    if rewards is None:
        rewards = shaped_rewards(algo, groups)
    if any(episode_parts(g) is not None for g in groups):  # split episodes: estimated over episodes
        outcomes = [by_episode(g, r, _last) for g, r in zip(groups, rewards)]
        lengths = [by_episode(g, n, np.sum) for g, n in zip(groups, loss_lengths(algo, groups))]
        rows = _estimate(algo, groups, outcomes, lengths)
        return [to_samples(g, row) for g, row in zip(groups, rows)]
    return _estimate(algo, groups, rewards, loss_lengths(algo, groups))


def _estimate(algo: AlgorithmConfig, groups: list[Group], rewards: list[np.ndarray], lengths: list[np.ndarray]):
    """``algorithm.adv_estimator`` over ``rewards`` (one row per group) of samples of ``lengths``."""
    if algo.adv_estimator == "remax":  # baseline: the reward of each prompt's greedy answer
        missing = [g.group_id for g in groups if g.greedy_reward is None]
        if missing:
            raise ValueError(f"groups {missing[:3]} have no greedy_reward (generator.greedy_baseline)")
        greedy = [float(g.greedy_reward) for g in groups]
        return [remax_advantages(r[None], np.array([b], dtype=np.float32))[0] for r, b in zip(rewards, greedy)]
    # gae's advantages are per token and need the critic (the training step); here, for replay
    # priorities, it stands in with the group-centred rewards.
    estimator = ADV_ESTIMATORS["dr_grpo" if algo.adv_estimator == "gae" else algo.adv_estimator]
    options = estimator_options(algo)
    sizes = {len(r) for r in rewards}
    if len(sizes) == 1:
        return list(estimator(np.stack(rewards), lengths=np.stack(lengths), **options))  # (G, n) -> G rows
    if algo.adv_estimator in BATCH_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator '{algo.adv_estimator}' needs groups of one size, got sizes {sorted(sizes)}"
        )
    return [estimator(r[None], lengths=n[None], **options)[0] for r, n in zip(rewards, lengths)]


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
