"""Per-token policy losses, ``POLICY_LOSSES`` by ``algorithm.policy_loss``: pure functions of (B, T) tensors.

Each takes log pi_theta (``logprobs``, with gradient), the anchor the ratio is taken against
(``old_logprobs``: pi_prox or mu, as the correction says; ``asyncrl.learner.losses``) and the
advantages, plus the keyword options it uses, and returns ``(pg_loss, clip)``: the (B, T)
per-token loss, and a (B, T) int8 tensor saying where a clip acted, so the step reports the
upper, lower and dual clip fractions apart (verl's ``pg_clipfrac``/``pg_clipfrac_lower``)::

    CLIP_HIGH  the ratio was cut at its ceiling (a positive advantage gets no more credit)
    CLIP_LOW   the ratio was cut at its floor (a negative advantage gets no more blame)
    CLIP_DUAL  the dual clip bounded a negative advantage's loss (the ratio exploded)
    CLIP_NONE  no clip acted: the token has its plain policy gradient

The aggregation over tokens, the correction weights and the keep mask are applied by
``compute_policy_loss`` (``asyncrl.learner.losses``), not here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: a log-ratio is clamped here before exp
GSPO_MAX_LOG_RATIO = 10.0  # exp(10) ~ 22026: GSPO's sequence log-ratio, clamped where verl clamps it

CLIP_LOW, CLIP_NONE, CLIP_HIGH, CLIP_DUAL = -1, 0, 1, 2


def clip_sides(clipped: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """(B, T) int8: ``CLIP_HIGH`` where ``clipped`` and the ratio is above 1, ``CLIP_LOW`` where
    clipped below 1, ``CLIP_NONE`` elsewhere."""
    side = torch.where(ratio > 1, CLIP_HIGH, CLIP_LOW).to(torch.int8)
    return torch.where(clipped, side, torch.zeros_like(side))


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7: L^CLIP, negated to a loss) with DAPO's
    clip-higher (Yu et al. 2025) and the dual clip (Ye et al. 2020).

        ratio    = exp(logprobs - old_logprobs)
        pg_loss1 = -A * ratio
        pg_loss2 = -A * clip(ratio, 1 - clip_low, 1 + clip_high)      (DAPO: clip_high > clip_low)
        pg_loss  = max(pg_loss1, pg_loss2)
        dual clip (Ye et al. 2020), for A < 0 only:  pg_loss = min(pg_loss, -A * dual_clip)

    The dual clip bounds the loss of a negative-advantage token whose ratio has exploded
    (mu sampled it, pi_theta now finds it far likelier), which plain PPO leaves unbounded.

    Returns:
        (pg_loss, clip), both (B, T): the per-token loss, and ``CLIP_HIGH`` (A > 0, ratio above
        1 + clip_high), ``CLIP_LOW`` (A < 0, ratio below 1 - clip_low), ``CLIP_DUAL`` (A < 0,
        ratio above dual_clip) or ``CLIP_NONE``.
    """
    if clip_low <= 0 or clip_high <= 0:
        raise ValueError(f"clip_low ({clip_low}) and clip_high ({clip_high}) must be > 0")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip ({dual_clip}) must be > 1 or None")
    ratio = (logprobs - old_logprobs).clamp(max=MAX_LOG_RATIO).exp()  # (B, T)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_loss = torch.max(pg_loss1, pg_loss2)  # (B, T)
    clip = clip_sides(pg_loss2 > pg_loss1, ratio)
    if dual_clip is not None:
        pg_loss3 = -advantages * dual_clip
        dual = (advantages < 0) & (pg_loss3 < pg_loss)
        pg_loss = torch.where(dual, pg_loss3, pg_loss)
        clip = torch.where(dual, torch.full_like(clip, CLIP_DUAL), clip)
    return pg_loss, clip


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level ratio.

        s_i      = exp( sum_t mask_t * (logprobs_t - old_logprobs_t) / |y_i| )   length-normalised
        s_{i,t}  = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))                    value s_i, gradient per token
        loss_t   = max(-A_i * s_{i,t}, -A_i * clip(s_{i,t}, 1 - clip_low, 1 + clip_high))

    Aggregated with ``seq-mean-token-mean`` this is GSPO's objective exactly; the clip decides
    per sequence, so the ranges are small (the paper uses 3e-4 / 4e-4).

    ``log s_{i,t}`` is clamped above at ``GSPO_MAX_LOG_RATIO`` = 10 before the exp, as verl's
    ``compute_policy_loss_gspo`` does (``torch.clamp(log_seq_importance_ratio, max=10.0)``), not at
    the token losses' 20: a sequence whose mean log-ratio passes 10 weighs exp(10) ~ 22,026 (not up
    to exp(20) ~ 4.9e8), and the same batch gives the same loss here and in verl. Only a negative
    advantage reaches it (a positive one is clipped at 1 + clip_high), and such a sequence is
    already far off-policy; the clamp, like verl's, cuts its gradient.
    """
    mask = mask.to(logprobs.dtype)
    length = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / length  # (B, 1)
    log_s = seq_log_ratio.detach() + logprobs - logprobs.detach()  # (B, T), value = seq_log_ratio
    s = log_s.clamp(max=GSPO_MAX_LOG_RATIO).exp()  # (B, T)
    pg_loss1 = -advantages * s
    pg_loss2 = -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high)
    return torch.max(pg_loss1, pg_loss2), clip_sides(pg_loss2 > pg_loss1, s.detach())


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_high: float = 0.2,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax 2025, "MiniMax-M1", section 3.1): clip the IS weight, not the update.

        ratio  = exp(logprobs - old_logprobs)
        loss_t = -sg(min(ratio, 1 + clip_high)) * A * logprobs

    Every token keeps a gradient (PPO zeroes clipped ones, which are often the rare "fork"
    tokens); the weight is only bounded, and those tokens count as ``CLIP_HIGH``. No lower bound,
    as in the paper (a large epsilon_low).
    """
    ratio = (logprobs - old_logprobs).clamp(max=MAX_LOG_RATIO).exp().detach()  # (B, T)
    weight = ratio.clamp(max=1 + clip_high)
    return -weight * advantages * logprobs, clip_sides(ratio > 1 + clip_high, ratio)


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a smooth,
    temperature-gated trust region instead of a hard clip.

        ratio  = exp(logprobs - old_logprobs)
        f(r)   = sigmoid(tau * (r - 1)) * 4 / tau,      tau = tau_pos if A > 0 else tau_neg
        loss_t = -f(ratio) * A

    d f / d r = 4 sigmoid'(tau (r - 1)) is 1 at r = 1, so on-policy tokens get exactly the plain
    policy gradient, and it decays smoothly as the ratio leaves 1 (faster for a larger tau),
    where PPO cuts it to 0 at a threshold. A larger tau_neg damps negative-advantage tokens
    sooner: their updates spread probability over the whole vocabulary and destabilise more.
    No token is hard-clipped, so every clip side is ``CLIP_NONE``. The paper aggregates with
    ``seq-mean-token-mean`` (verl forces it); here the configured ``loss_agg_mode`` applies.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos ({tau_pos}) and tau_neg ({tau_neg}) must be > 0")
    ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # (B, T)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    return -gate * advantages, torch.zeros_like(ratio, dtype=torch.int8)


def gmpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673): the
    geometric mean of the token ratios, clipped token by token in log space.

        l_t   = logprobs_t - old_logprobs_t
        c_t   = min(l_t, clip_high)        if A > 0        (sgn(A) * min(sgn(A) l_t, sgn(A) clip(l_t, -clip_low, clip_high)))
                max(l_t, -clip_low)        if A < 0
        R_i   = exp( sum_t mask_t * c_t / |y_i| )          the geometric mean of the clipped ratios
        loss  = -A_i * R_i                                  on every token of sequence i

    The clip range is on the log-ratio: the ratio stays in [e^-clip_low, e^clip_high] (the paper
    uses 0.4 each, (0.67, 1.49), wider than PPO's because the geometric mean is less sensitive
    to one token's outlier ratio than the arithmetic mean). The loss value is the sequence's on
    each of its tokens, the gradient reaching every unclipped token through R_i; aggregated
    with ``seq-mean-token-mean`` this is the paper's objective, the mean over sequences of
    -A_i R_i. It needs one advantage per sequence (an outcome estimator, not gae).

    Returns:
        (pg_loss, clip): ``CLIP_HIGH`` where A > 0 and l_t > clip_high, ``CLIP_LOW`` where
        A < 0 and l_t < -clip_low.
    """
    if clip_low <= 0 or clip_high <= 0:
        raise ValueError(f"clip_low ({clip_low}) and clip_high ({clip_high}) must be > 0")
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs  # (B, T)
    clipped_log_ratio = torch.where(
        advantages > 0, log_ratio.clamp(max=clip_high), log_ratio.clamp(min=-clip_low)
    )  # A == 0: the loss is 0 whatever R_i is
    length = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    mean_log_ratio = (clipped_log_ratio * mask).sum(dim=1, keepdim=True) / length  # (B, 1)
    seq_ratio = mean_log_ratio.clamp(max=MAX_LOG_RATIO).exp()  # (B, 1)
    clipped = (clipped_log_ratio != log_ratio) & (advantages != 0)
    return -advantages * seq_ratio, clip_sides(clipped, log_ratio.detach().exp())


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "gmpo": gmpo_loss,
}
"""Per-token policy losses by ``algorithm.policy_loss``: (logprobs, anchor, A, *, mask, clip_low,
clip_high, dual_clip, tau_pos, tau_neg) -> (pg_loss, clip side), each taking the options it uses."""
