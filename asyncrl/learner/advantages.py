"""Advantage estimators: pure functions, one per paper, and ``ADV_ESTIMATORS`` by config name.

Outcome estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax) map the (G, n) rewards of G groups
of n samples of one prompt each to (G, n) advantages; every token of an answer gets its answer's
advantage. They need no value network: the other answers to the same prompt (or the batch, or a
greedy answer) are the baseline. ``gae_advantages`` and ``vtrace_targets`` are the token-level
estimators of an actor-critic learner (PPO with a value model); they are here, tested, for the
critic that is not wired yet.

Deliberate simplification: a KL penalty used as a reward (``algorithm.kl.use_in = reward``) is
subtracted from the sequence's reward as the sum of its per-token KL before these functions run,
so REINFORCE++ sees one return per sequence (OpenRLHF spreads it per token; with gamma = 1 the
first token's return is the same).
"""

from __future__ import annotations

import numpy as np
import torch


def grpo_advantages(
    rewards: np.ndarray | torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> np.ndarray | torch.Tensor:
    """Group-normalised advantages, one per sample.

    For the rewards r_1..r_n of the n samples of one group (one row)::

        A_i = (r_i - mean(r)) / (std(r) + eps)      if scale_by_std
        A_i =  r_i - mean(r)                        otherwise (Dr. GRPO, Liu et al. 2025)

    ``std`` is the population standard deviation (``unbiased=False``, divide by n, not n - 1), so a
    group with rewards [1, 0, 0, 1] has std 0.5 and advantages [1, -1, -1, 1] (up to ``eps``).
    A group whose rewards are all equal (all right or all wrong) has advantages 0: it carries no
    learning signal, and ``eps`` keeps the division finite. Dropping the std scaling removes
    the bias towards groups that are almost all right or all wrong (whose small std inflates A).

    Args:
        rewards: (G, n) rewards of G groups of n samples; numpy or torch.
        eps: added to the std so that a zero-variance group divides by ``eps``, not 0.
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).

    Returns:
        (G, n) advantages, float, of the input's kind (numpy in, numpy out; torch in, torch out).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    if eps < 0:
        raise ValueError(f"eps ({eps}) must be >= 0")
    if isinstance(rewards, torch.Tensor):
        r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
        centred = r - r.mean(dim=1, keepdim=True)  # (G, n)
        if not scale_by_std:
            return centred
        return centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)  # (G, n)
    r = np.asarray(rewards)
    r = r.astype(np.float64 if r.dtype == np.float64 else np.float32)  # keep float64, else float32
    centred = r - r.mean(axis=1, keepdims=True)  # (G, n)
    if not scale_by_std:
        return centred
    return centred / (r.std(axis=1, ddof=0, keepdims=True) + eps)  # (G, n)


def dr_grpo_advantages(rewards: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): group-centred, no std.

        A_i = r_i - mean(r)

    The other half of Dr. GRPO, no division by the answer's length, is the loss aggregation
    ``seq-mean-token-sum-norm`` (token sums over a constant).
    """
    return grpo_advantages(rewards, scale_by_std=False)


def rloo_advantages(rewards: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    Each answer's baseline is the mean reward of the *other* n - 1 answers to its prompt::

        A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean(r))

    Unbiased (the baseline does not depend on the answer it scores). Needs n >= 2.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"group size ({n}) must be >= 2 for a leave-one-out baseline")
    return grpo_advantages(rewards, scale_by_std=False) * (n / (n - 1))


def _whiten(x, eps: float):
    if isinstance(x, torch.Tensor):
        return (x - x.mean()) / (x.std(unbiased=False) + eps)
    return (x - x.mean()) / (x.std(ddof=0) + eps)


def reinforce_pp_advantages(
    rewards: np.ndarray | torch.Tensor, group_baseline: bool = False, eps: float = 1e-6
) -> np.ndarray | torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++"): batch-normalised returns, optionally group-centred first.

    Over all B = G * n samples of the batch (not per group)::

        without baseline:  A = (r - mean_batch(r)) / (std_batch(r) + eps)
        with baseline:     a_i = r_i - mean_group(r);  A = (a - mean_batch(a)) / (std_batch(a) + eps)

    The batch-wide statistics are the point: a group whose answers all score alike still has
    a spread in the batch, and the scale of the advantages does not depend on one group's std
    (which GRPO divides by, inflating nearly-uniform groups).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    if isinstance(rewards, torch.Tensor):
        r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    else:
        r = np.asarray(rewards)
        r = r.astype(np.float64 if r.dtype == np.float64 else np.float32)
    if group_baseline:
        r = grpo_advantages(r, scale_by_std=False)  # (G, n) group-centred
    return _whiten(r, eps)  # (G, n)


def reinforce_pp_baseline_advantages(rewards: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """REINFORCE++ with the group mean as baseline, then batch whitening (``reinforce_pp_advantages``)."""
    return reinforce_pp_advantages(rewards, group_baseline=True)


def remax_advantages(
    rewards: np.ndarray | torch.Tensor, greedy_rewards: np.ndarray | torch.Tensor
) -> np.ndarray | torch.Tensor:
    """ReMax (Li et al. 2024): the baseline is the reward of the prompt's greedy answer::

    A_i = r_i - r_greedy          rewards (G, n), greedy_rewards (G,)
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    if tuple(greedy_rewards.shape) != (rewards.shape[0],):
        raise ValueError(
            f"greedy_rewards shape {tuple(greedy_rewards.shape)} must be ({rewards.shape[0]},): one per group"
        )
    return rewards - greedy_rewards[:, None]


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), right-padded token sequences.

    With V(s_T) = 0 after the last response token (the episode ends there)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                      (the critic's target)

    Args:
        rewards: (B, T) per-token rewards (typically the outcome reward on the last token, minus
            any per-token KL penalty).
        values: (B, T) critic values V(s_t) of the same positions.
        mask: (B, T) 1 on response tokens; padding contributes nothing and bootstraps 0.

    Returns:
        (advantages, returns), both (B, T), 0 off the mask.
    """
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    mask = mask.to(values.dtype)
    T = rewards.shape[1]
    advantages = torch.zeros_like(values)  # (B, T)
    next_adv = torch.zeros_like(values[:, 0])  # (B,)
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = (delta + gamma * lam * next_adv) * m
        advantages[:, t] = adv_t
        # padding passes the next real token's quantities through unchanged (right padding: zeros)
        next_adv = adv_t + (1 - m) * next_adv
        next_value = values[:, t] * m + (1 - m) * next_value
    return advantages, (advantages + values) * mask


def vtrace_targets(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rhos: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets for a critic trained on stale samples (Espeholt et al. 2018, IMPALA, eq. 1).

    With rho_t = min(rho_bar, pi/mu), c_t = min(c_bar, pi/mu) and V after the last token 0::

        delta_t = rho_t * (r_t + gamma * V_{t+1} - V_t)
        v_t     = V_t + delta_t + gamma * c_t * (v_{t+1} - V_{t+1})
        A_t     = rho_t * (r_t + gamma * v_{t+1} - V_t)          (policy-gradient advantage)

    With pi == mu (log_rhos 0) and rho_bar, c_bar >= 1, v_t is the lambda = 1 return (sum of
    future rewards for gamma = 1).

    Returns:
        (vs, advantages), both (B, T), 0 off the mask.
    """
    if not (rewards.shape == values.shape == log_rhos.shape == mask.shape):
        raise ValueError("rewards, values, log_rhos and mask must have one shape (B, T)")
    mask = mask.to(values.dtype)
    rhos = log_rhos.exp()
    clipped_rho = rhos.clamp(max=rho_bar)  # (B, T)
    cs = rhos.clamp(max=c_bar)  # (B, T)
    T = rewards.shape[1]
    vs = torch.zeros_like(values)
    advantages = torch.zeros_like(values)
    next_vs = torch.zeros_like(values[:, 0])  # v_{t+1}
    next_value = torch.zeros_like(values[:, 0])  # V_{t+1}
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = clipped_rho[:, t] * (rewards[:, t] + gamma * next_value - values[:, t])
        v_t = values[:, t] + delta + gamma * cs[:, t] * (next_vs - next_value)
        adv_t = clipped_rho[:, t] * (rewards[:, t] + gamma * next_vs - values[:, t])
        vs[:, t] = v_t * m
        advantages[:, t] = adv_t * m
        next_vs = v_t * m + (1 - m) * next_vs
        next_value = values[:, t] * m + (1 - m) * next_value
    return vs, advantages


ADV_ESTIMATORS = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}
"""Outcome estimators by ``algorithm.adv_estimator``: (G, n) rewards -> (G, n) advantages.
``remax`` (needs greedy rewards) and ``gae`` (needs a critic) take more inputs and are not here."""

BATCH_ESTIMATORS = frozenset({"reinforce_pp", "reinforce_pp_baseline"})
"""Estimators whose statistics span the whole batch, not one group."""
