"""Advantage estimators: pure functions, one per paper, and ``ADV_ESTIMATORS`` by config name.

Outcome estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++, OPO, pass@k) map the (G, n) rewards of G
groups of n samples of one prompt each to (G, n) advantages; every token of an answer gets its
answer's advantage. They need no value network: the other answers to the same prompt (or the
batch) are the baseline. ReMax (a greedy answer's reward) takes one more input.
``gae_advantages`` and ``vtrace_targets`` are the token-level estimators of the actor-critic
learner (``asyncrl.learner.critic``).

Per-token rewards (``Sample.token_rewards``: a reward that scores tokens, e.g. each turn of a
multi-turn episode) are credited token by token by those two and by REINFORCE++: the critic
places each on the token that earned it (one on an environment's answer on the model token
before it) and the rest of the sample's reward on its last trained token; REINFORCE++ (token
whitening) whitens each token's return, the rewards earned before it taken out
(``reinforce_pp_token_advantages``). The other outcome estimators (GRPO, Dr. GRPO, RLOO, OPO,
pass@k) see the sample's reward, of which the per-token rewards' sum is a part: every token of
the answer gets the answer's advantage, as for single-turn answers; their baselines are other
answers' rewards, which have no per-token counterpart. Across the model's turns of an
episode only its trained tokens are steps of the estimators; the environment's tokens are passed
over (``gae_advantages``: masked positions carry the next step's quantities through).

Every function of ``ADV_ESTIMATORS`` is called with the same keyword arguments and takes the ones
it uses: ``lengths`` ((G, n) response tokens of each sample, for the token-weighted statistics of
REINFORCE++ and OPO's baseline), ``unbiased`` (``algorithm.std_estimator``: divide the variance by
N - 1 instead of N) and ``k`` (pass@k).

Deliberate simplification: a KL penalty used as a reward (``algorithm.kl.use_in = reward``) is
subtracted from the sequence's reward as the sum of its per-token KL before these functions run,
so REINFORCE++ sees one return per sequence. OpenRLHF spreads the KL per token; with gamma = 1 the
*return* of a sequence's first token is the same, and REINFORCE++'s token-level whitening
(``reinforce_pp_advantages``) then weighs each sequence by its token count, as OpenRLHF's does.
The whitened advantages still differ from OpenRLHF's token by token: there each token's return is
the reward minus the KL of the tokens after it, so advantages vary along a sequence; here every
token of a sequence carries the sequence's.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def grpo_advantages(
    rewards: np.ndarray | torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True, unbiased: bool = False, **_
) -> np.ndarray | torch.Tensor:
    """Group-normalised advantages, one per sample.

    For the rewards r_1..r_n of the n samples of one group (one row)::

        A_i = (r_i - mean(r)) / (std(r) + eps)      if scale_by_std
        A_i =  r_i - mean(r)                        otherwise (Dr. GRPO, Liu et al. 2025)

    ``std`` is the population standard deviation by default (``unbiased=False``: divide by n), so a
    group with rewards [1, 0, 0, 1] has std 0.5 and advantages [1, -1, -1, 1] (up to ``eps``).
    This differs from the references: verl, OpenRLHF and trl all take ``torch.std``'s default for
    the group std, which divides by n - 1 (``unbiased=True``, ``algorithm.std_estimator:
    unbiased`` in a recipe that must match them) and scales every advantage by sqrt((n - 1) / n):
    x0.71 at n = 2, x0.94 at n = 8. The population form is kept as the default because it is the
    same estimator as every other std the advantages take (REINFORCE++'s batch whitening and the
    critic's, as OpenRLHF whitens), and a group of two answers, one right, gets advantages +-1.
    A group whose rewards are all equal (all right or all wrong) has advantages 0: it carries no
    learning signal, and ``eps`` keeps the division finite. Dropping the std scaling removes
    the bias towards groups that are almost all right or all wrong (whose small std inflates A).

    Args:
        rewards: (G, n) rewards of G groups of n samples; numpy or torch.
        eps: added to the std so that a zero-variance group divides by ``eps``, not 0.
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        unbiased: the std estimator (``algorithm.std_estimator``): n - 1 (True) or n (False).

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
        return centred / (r.std(dim=1, unbiased=unbiased, keepdim=True) + eps)  # (G, n)
    r = np.asarray(rewards)
    r = r.astype(np.float64 if r.dtype == np.float64 else np.float32)  # keep float64, else float32
    centred = r - r.mean(axis=1, keepdims=True)  # (G, n)
    if not scale_by_std:
        return centred
    return centred / (r.std(axis=1, ddof=int(unbiased), keepdims=True) + eps)  # (G, n)


def dr_grpo_advantages(rewards: np.ndarray | torch.Tensor, **_) -> np.ndarray | torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): group-centred, no std.

        A_i = r_i - mean(r)

    The other half of Dr. GRPO, no division by the answer's length, is the loss aggregation
    ``seq-mean-token-sum-norm`` (token sums over a constant).
    """
    return grpo_advantages(rewards, scale_by_std=False)


def rloo_advantages(rewards: np.ndarray | torch.Tensor, **_) -> np.ndarray | torch.Tensor:
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


def opo_advantages(
    rewards: np.ndarray | torch.Tensor, lengths: np.ndarray | torch.Tensor | None = None, **_
) -> np.ndarray | torch.Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", section 3): the group's
    length-weighted mean reward is the baseline.

        b = sum_i l_i * r_i / sum_i l_i,      A_i = r_i - b           (l_i: response tokens of i)

    The baseline that minimises the policy gradient's variance when each sample's squared
    gradient norm grows in proportion to its length (the paper's assumption under strict
    on-policy training); with equal lengths it is Dr. GRPO's plain mean. A group whose lengths
    are all 0 takes the plain mean.

    Args:
        rewards: (G, n) rewards. lengths: (G, n) response tokens of each sample (required).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    if lengths is None:
        raise ValueError("opo needs each sample's response length (lengths), got None")
    r = _as_float(rewards)
    values = r.detach().cpu().double().numpy() if isinstance(r, torch.Tensor) else r.astype(np.float64)
    tokens = np.asarray(lengths, dtype=np.float64)  # (G, n)
    if tokens.shape != values.shape:
        raise ValueError(f"lengths shape {tokens.shape} must equal rewards shape {values.shape}")
    if (tokens < 0).any():
        raise ValueError(f"lengths ({tokens.tolist()}) must be >= 0")
    tokens = np.where(tokens.sum(axis=1, keepdims=True) > 0, tokens, 1.0)  # all-empty group: the plain mean
    baseline = (tokens * values).sum(axis=1, keepdims=True) / tokens.sum(axis=1, keepdims=True)  # (G, 1)
    return _like(values - baseline, r)


def _like(values: np.ndarray, reference: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """float64 ``values`` in ``reference``'s kind and dtype."""
    if isinstance(reference, torch.Tensor):
        return torch.from_numpy(values).to(reference.dtype)
    return values.astype(reference.dtype)


def _max_distribution(size: int, m: int) -> np.ndarray:
    """P(the maximum of a uniformly random m-subset of ``size`` sorted values is the j-th), j = 0..size-1:
    C(j, m - 1) / C(size, m) (ties broken by position, which leaves every expectation exact)."""
    total = math.comb(size, m)
    return np.array([math.comb(j, m - 1) / total for j in range(size)], dtype=np.float64)


def pass_at_k_advantages(rewards: np.ndarray | torch.Tensor, k: int = 1, eps: float = 1e-6, **_):
    """Pass@k training's analytical advantage (Chen et al. 2025, "Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models", section 4), for any rewards.

    The reward of a k-subset S of the group is its best answer's, max_{j in S} r_j. Over the
    C(n, k) subsets of a group of n::

        R_bar = E_S[max r_S],   sigma = std_S[max r_S],   A_i = (E_{S : i in S}[max r_S] - R_bar) / (sigma + eps)

    i.e. each answer's advantage is the mean normalised advantage of the subsets it belongs to.
    With 0/1 rewards (N_neg wrong answers of N) this is the paper's closed form::

        R_bar = 1 - C(N_neg, k) / C(N, k),   sigma = sqrt(R_bar (1 - R_bar)),
        A_pos = (1 - R_bar) / sigma,         A_neg = (1 - R_bar - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma

    k = 1 is GRPO (population std). A right answer's advantage no longer depends on how many
    others are right beyond the first k - 1 chances, and a wrong one is penalised only by the
    subsets it spoils: the signal favours groups that explore. The expectations are exact
    (O(n^2) per group, from the order statistics), not sampled.

    Args:
        rewards: (G, n) rewards; numpy or torch. k: the subset size, 1 <= k <= n.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    n = rewards.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k ({k}) must be in [1, group size {n}]")
    r = _as_float(rewards)
    values = r.detach().cpu().double().numpy() if isinstance(r, torch.Tensor) else r.astype(np.float64)
    p_k = _max_distribution(n, k)  # over the group's sorted rewards
    p_others = _max_distribution(n - 1, k - 1) if k > 1 else None  # over the others', sorted
    out = np.zeros_like(values)  # (G, n)
    for g, row in enumerate(values):
        ordered = np.sort(row)
        mean = float((p_k * ordered).sum())
        sigma = math.sqrt(max(float((p_k * ordered**2).sum()) - mean**2, 0.0))
        for i in range(n):
            if p_others is None:
                with_i = row[i]
            else:
                others = np.sort(np.delete(row, i))
                with_i = float((p_others * np.maximum(row[i], others)).sum())
            out[g, i] = (with_i - mean) / (sigma + eps)
    return _like(out, r)


def _as_float(rewards: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """Rewards as floats of their own kind: torch stays torch; numpy keeps float64, else float32."""
    if isinstance(rewards, torch.Tensor):
        return rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    r = np.asarray(rewards)
    return r.astype(np.float64 if r.dtype == np.float64 else np.float32)


def weighted_whiten(x, weights=None, eps: float = 1e-6, unbiased: bool = False):
    """(x - mean) / (std + eps) with each entry of ``x`` counted ``weights`` times (None: once).

        N = sum w,   mean = sum w x / N,   var = sum w (x - mean)^2 / N      (unbiased: / (N - 1))

    With ``weights`` the response token counts of one-value-per-sequence ``x``, these are exactly
    the mean and variance over every token of the batch (each token carries its sequence's x).
    ``x`` and ``weights`` are numpy or torch, of one shape; the result is of ``x``'s kind.
    """
    if isinstance(x, torch.Tensor):
        w = torch.ones_like(x) if weights is None else torch.as_tensor(np.asarray(weights), dtype=x.dtype)
    else:
        w = np.ones(x.shape) if weights is None else np.asarray(weights, dtype=np.float64)
    if tuple(w.shape) != tuple(x.shape):
        raise ValueError(f"weights shape {tuple(w.shape)} must equal the values' shape {tuple(x.shape)}")
    if bool((w < 0).any()):
        raise ValueError(f"weights ({w.tolist()}) must be >= 0")
    n = float(w.sum())
    if n <= (1.0 if unbiased else 0.0):
        raise ValueError(f"the weights' total ({n}) must be > {1 if unbiased else 0} to whiten")
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / (n - 1 if unbiased else n)
    out = (x - mean) / (var**0.5 + eps)
    return out if isinstance(x, torch.Tensor) else out.astype(x.dtype)


def reinforce_pp_advantages(
    rewards: np.ndarray | torch.Tensor,
    group_baseline: bool = False,
    eps: float = 1e-6,
    lengths: np.ndarray | torch.Tensor | None = None,
    unbiased: bool = False,
    whitening: str = "token",
    **_,
) -> np.ndarray | torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Normalization", section 3): the return, optionally group-centred, whitened over the batch.

    The paper's global advantage normalisation, over every valid token t of every sample i of
    the batch B (not per group)::

        A_{i,t} = (R_{i,t} - mean_{(j,s) in B} R_{j,s}) / std_{(j,s) in B} R_{j,s}

    where R_{i,t} is the return from token t: with the outcome reward and gamma = 1 it is r_i at
    every token of sample i (a KL penalty is already in r_i, see the module docstring), or the
    group-centred r_i - mean_group(r) with ``group_baseline`` (REINFORCE++ w/ baseline). So the
    whitened advantage is still one value per sequence, and the statistics over tokens are the
    statistics over sequences weighted by their token counts ``lengths``: a long answer weighs
    more, as in OpenRLHF and verl. ``whitening="sequence"`` (or ``lengths=None``) gives the
    sequence form, every sample weighing the same, which this function computed before the
    token form was the default (``algorithm.reinforce_pp_whitening: sequence``).

    The batch-wide statistics are the point: a group whose answers all score alike still has
    a spread in the batch, and the scale of the advantages does not depend on one group's std
    (which GRPO divides by, inflating nearly-uniform groups).

    Args:
        rewards: (G, n) rewards; numpy or torch.
        group_baseline: subtract each group's mean reward first.
        eps: added to the std (OpenRLHF clamps the variance at 1e-8 instead; verl adds 1e-8 to it).
        lengths: (G, n) response tokens of each sample; None: weigh each sample once.
        unbiased: divide the variance by N - 1 (N the tokens, or samples), as verl does; False: by N.
        whitening: "token" (the paper's: weigh by ``lengths``) or "sequence" (each sample once).
    """
    if whitening not in ("token", "sequence"):
        raise ValueError(f"whitening ({whitening!r}) must be 'token' or 'sequence'")
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    r = _as_float(rewards)
    if group_baseline:
        r = grpo_advantages(r, scale_by_std=False)  # (G, n) group-centred
    return weighted_whiten(r, lengths if whitening == "token" else None, eps, unbiased)  # (G, n)


def reinforce_pp_token_advantages(
    returns: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, unbiased: bool = False
) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, section 3) with per-token rewards: the return from each token,
    whitened over every trained token of the batch.

    With gamma = 1 the return from token t is what the sample earns from t on. A sample's
    reward R_i already holds the sum of its per-token rewards r_{i,t'} (a multi-turn episode's
    step rewards), so the rewards earned before t are taken out of it::

        R_{i,t} = R_i - sum_{t' < t} r_{i,t'}
        A_{i,t} = (R_{i,t} - mean_{(j,s) in B} R_{j,s}) / (std_{(j,s) in B} R_{j,s} + eps)

    over the trained tokens (``mask``); a token is credited with a reward it earned or one that
    comes after it, never one before it. Without per-token rewards this is
    ``reinforce_pp_advantages`` with token whitening, the trained tokens weighing each sequence.

    Args:
        returns: (B,) each sample's reward (group-centred for the baseline variant, a KL
            penalty already taken out).
        token_rewards: (B, T) per-token rewards on the positions of the tokens that earned them.
        mask: (B, T) 1 on trained tokens.
        unbiased: divide the variance by N - 1 (N the trained tokens).

    >>> mask = torch.ones(2, 3)
    >>> a = reinforce_pp_token_advantages(torch.tensor([1.0, 0.0]), torch.tensor([[0.5, 0, 0], [0, 0, 0]]), mask)
    >>> [round(x, 2) for x in a[0].tolist()]  # the first token earned 0.5 more than the ones after it
    [1.79, 0.45, 0.45]
    """
    earned = token_rewards * mask
    before = torch.cumsum(earned, dim=1) - earned  # (B, T): earned strictly before t
    ret = (returns[:, None] - before) * mask
    n = mask.sum().clamp(min=1)
    mean = ret.sum() / n
    var = (((ret - mean) * mask) ** 2).sum() / (n - 1 if unbiased and n > 1 else n)
    return (ret - mean) / (var.sqrt() + eps) * mask


def reinforce_pp_baseline_advantages(rewards: np.ndarray | torch.Tensor, **options) -> np.ndarray | torch.Tensor:
    """REINFORCE++ with the group mean as baseline, then batch whitening (``reinforce_pp_advantages``)."""
    return reinforce_pp_advantages(rewards, group_baseline=True, **options)


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
    "opo": opo_advantages,
    "pass_at_k": pass_at_k_advantages,
}
"""Outcome estimators by ``algorithm.adv_estimator``: (G, n) rewards, **options -> (G, n) advantages.
``remax`` (needs greedy rewards) and ``gae`` (needs a critic) take more inputs and are not here."""

BATCH_ESTIMATORS = frozenset({"reinforce_pp", "reinforce_pp_baseline"})
"""Estimators whose statistics span the whole batch, not one group."""
