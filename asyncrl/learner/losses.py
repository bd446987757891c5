"""Off-policy corrections, loss aggregation and their composition with a policy loss: pure
functions of (B, T) tensors (the policy losses are ``asyncrl.learner.policy_losses``).

The learner trains on samples that generators drew with older weights: a group in the buffer can
be k learner steps old by the time it is trained on. Three policies are in play per token:

- the *behaviour* policy mu, which sampled the tokens (the generator's weights, k versions old;
  its log-probabilities travel with the sample);
- the *proximal* policy pi_prox, the learner's current weights before this update (recomputed
  by the learner's forward pass: with one optimizer step per batch, ``logprobs.detach()``);
- pi_theta, the policy being optimised (``logprobs``, with gradient).

A step's loss is composed of three choices, each a plain dict from config name to function,
and ``compute_policy_loss`` is the one place that composes them (every function of a dict is
called with the same keyword arguments, and takes the ones it needs):

1. ``CORRECTIONS[algorithm.correction]``: which log-probabilities the PPO ratio is taken against
   (the trust-region anchor), and a detached per-token weight and keep-mask correcting for mu.
2. ``POLICY_LOSSES[algorithm.policy_loss]``: the per-token surrogate (B, T) given that anchor
   (``asyncrl.learner.policy_losses``).
3. ``LOSS_AGG_MODES[algorithm.loss_agg_mode]``: how token losses become one number.

The decoupled objective (AReaL, Fu et al. 2025, section 5.2; Hilton et al. 2022, section 3)

    J(theta) = E_mu[ sum_t  pi_prox / mu * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps) * A_t) ],
    u_t = pi_theta(y_t) / pi_prox(y_t)

is correction ``decoupled`` with ``ppo_clip``: it clips around pi_prox and weights by pi_prox / mu.
With mu equal to pi_prox (fresh samples, no sampler mismatch) every correction reduces to plain
PPO. ``decoupled_ppo_loss`` is that composition in one call with float statistics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.policy_losses import CLIP_DUAL, CLIP_HIGH, CLIP_LOW, POLICY_LOSSES
from asyncrl.learner.rejection import REJECTIONS, batch_normalised_weights, weight_sums

_MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: the log of an importance weight is clamped here before exp


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1; 0 (not NaN) when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _check_shapes(logprobs: torch.Tensor, **others: torch.Tensor) -> None:
    for name, value in others.items():
        if value.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(value.shape)} must equal logprobs shape {tuple(logprobs.shape)}")


# ---------------------------------------------------------------------------------------------
# off-policy corrections: (anchor logprobs, detached weight, keep mask)


def _log_weights(proximal_logprobs, behaviour_logprobs, mask, level: str) -> torch.Tensor:
    """log(pi_prox / mu) per token, or per sequence (sum over its tokens) broadcast to its tokens."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level ({level!r}) must be 'token' or 'sequence'")
    log_w = (proximal_logprobs - behaviour_logprobs) * mask  # (B, T)
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)  # (B, T), one value per row
    return log_w.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)


def no_correction(proximal_logprobs, behaviour_logprobs, mask, **_):
    """The naive choice: the learner's recomputed logprobs stand for mu; mu is ignored.

        anchor = pi_prox,  w = 1

    Stale samples are trained as if the current policy had sampled them.
    """
    return proximal_logprobs, torch.ones_like(mask), mask


def behaviour_ppo_correction(proximal_logprobs, behaviour_logprobs, mask, **_):
    """Standard PPO with the sampler as the old policy: the ratio is pi_theta / mu, clipped.

        anchor = mu,  w = 1

    On stale samples most ratios sit outside the clip range, so those tokens get no gradient.
    """
    return behaviour_logprobs, torch.ones_like(mask), mask


def truncated_is_correction(proximal_logprobs, behaviour_logprobs, mask, level="token", cap=2.0, **_):
    """Truncated importance sampling (Espeholt et al. 2018; Yao et al. 2025 for sampler mismatch).

    anchor = pi_prox,  w = min(pi_prox / mu, C)          per token, or per sequence
                                                         (w = min(prod_t pi_prox / mu, C))
    """
    if cap is None or cap < 1:
        raise ValueError(f"cap ({cap}) must be >= 1 for truncated importance sampling")
    w = _log_weights(proximal_logprobs, behaviour_logprobs, mask, level).exp().clamp(max=cap)
    return proximal_logprobs, w, mask


def masked_is_correction(proximal_logprobs, behaviour_logprobs, mask, level="token", low=0.5, high=2.0, **_):
    """Masked importance sampling (ICEPOP, token level; MIS, sequence level).

        anchor = pi_prox,  w = pi_prox / mu,  keep = mask * 1[low <= w <= high]

    Tokens (sequences) whose weight leaves [low, high] are dropped, not truncated: a token mu
    and pi_prox disagree on that much is treated as noise rather than scaled signal.
    """
    if not 0 <= low < high:
        raise ValueError(f"bounds ({low}, {high}) must satisfy 0 <= low < high")
    w = _log_weights(proximal_logprobs, behaviour_logprobs, mask, level).exp()
    keep = mask * ((w >= low) & (w <= high)).to(mask.dtype)
    return proximal_logprobs, w * keep, keep


def decoupled_correction(proximal_logprobs, behaviour_logprobs, mask, cap=None, **_):
    """AReaL's decoupled objective: clip around pi_prox, weight by pi_prox / mu, optionally truncated.

        anchor = pi_prox,  w = min(pi_prox / mu, cap)        (cap None: no truncation)

    AReaL drops tokens above its cap; this truncates them (as the demo always has). With one
    optimizer step per batch the loss equals token-level ``tis`` with C = cap; they part ways
    with ``proximal = log_linear`` (``log_linear_proximal_logprobs``).
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap ({cap}) must be >= 1 or None")
    w = _log_weights(proximal_logprobs, behaviour_logprobs, mask, "token").exp()
    if cap is not None:
        w = w.clamp(max=cap)
    return proximal_logprobs, w, mask


CORRECTIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "none": no_correction,
    "behaviour_ppo": behaviour_ppo_correction,
    "tis": truncated_is_correction,
    "mis": masked_is_correction,
    "decoupled": decoupled_correction,
}
"""Off-policy corrections by ``algorithm.correction``: (pi_prox, mu, mask, **options) -> (anchor, w, keep)."""


def log_linear_proximal_logprobs(
    behaviour_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    behaviour_version: torch.Tensor,
    proximal_version: int,
    current_version: int,
) -> torch.Tensor:
    """AReaL's approximation of pi_prox without a forward pass: interpolate in log space by version.

        alpha       = (v_prox - v_mu) / (v_theta - v_mu)       (1 where v_theta == v_mu)
        log pi_prox ~ log mu + alpha * (log pi_theta - log mu)

    ``behaviour_version``: (B, T), the version that sampled each token (a sample spanning a
    weight update interpolates each of its segments from its own version), or (B,), one per
    sequence. With one optimizer step per batch, v_prox == v_theta and this is exactly pi_theta
    (detached).
    """
    if behaviour_version.dim() == 1:
        behaviour_version = behaviour_version[:, None]  # (B, 1): one version for the whole row
    gap = (current_version - behaviour_version).to(logprobs.dtype)  # (B, T) or (B, 1)
    alpha = torch.where(gap > 0, (proximal_version - behaviour_version).to(logprobs.dtype) / gap.clamp(min=1), 1.0)
    return (behaviour_logprobs + alpha * (logprobs.detach() - behaviour_logprobs)).detach()


# ---------------------------------------------------------------------------------------------
# aggregation: (B, T) token losses -> scalar. Denominators may be given for the whole batch, so
# that micro batches' losses sum to the batch's loss.
#
# A fully masked row (no token in the loss: a sequence-level masked IS or rejection drop, a
# row of zero length) adds 0 to every numerator. The token modes do not count it at all. The
# seq-mean modes count it as a sequence of loss 0 when they count the rows themselves (num_seqs
# None: mask.shape[0]); given num_seqs, the caller decides, and the learner's step counts every
# row in the loss (all but truncated rows under truncation mode mask), so a row dropped whole
# still counts. verl, counting the rows itself, leaves fully masked rows out of the mean.


def token_mean(token_loss, mask, num_tokens=None, num_seqs=None, norm_tokens=None):
    """sum_{b,t} mask * loss / num_tokens   (every token weighs the same; DAPO)."""
    n = mask.sum() if num_tokens is None else num_tokens
    return (token_loss * mask).sum() / max(float(n), 1.0)


def token_sum(token_loss, mask, num_tokens=None, num_seqs=None, norm_tokens=None):
    """sum_{b,t} mask * loss   (no normalisation: the loss and its gradient grow with the batch's
    tokens, so the learning rate carries the scale; micro batches' sums add up to the batch's)."""
    return (token_loss * mask).sum()


def seq_mean_token_sum(token_loss, mask, num_tokens=None, num_seqs=None, norm_tokens=None):
    """sum_b sum_t mask * loss / num_seqs   (each sequence's token sum; long answers weigh more).

    num_seqs None: mask.shape[0], fully masked rows included (each adds 0)."""
    n = mask.shape[0] if num_seqs is None else num_seqs
    return (token_loss * mask).sum() / max(float(n), 1.0)


def seq_mean_token_mean(token_loss, mask, num_tokens=None, num_seqs=None, norm_tokens=None):
    """sum_b (sum_t mask * loss / |y_b|) / num_seqs   (original GRPO: every sequence weighs the same).

    num_seqs None: mask.shape[0], fully masked rows included (|y_b| = 0: their mean is 0)."""
    n = mask.shape[0] if num_seqs is None else num_seqs
    per_seq = (token_loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (B,)
    return per_seq.sum() / max(float(n), 1.0)


def seq_mean_token_sum_norm(token_loss, mask, num_tokens=None, num_seqs=None, norm_tokens=None):
    """sum_{b,t} mask * loss / (num_seqs * norm_tokens)   (Dr. GRPO: a constant, no length bias).

    ``norm_tokens`` is a constant (the maximum response length); None: this batch's T.
    num_seqs None: mask.shape[0], fully masked rows included (each adds 0). verl divides by
    norm_tokens only (its sum over the mini-batch's sequences is not divided by their count).
    """
    n = mask.shape[0] if num_seqs is None else num_seqs
    norm = mask.shape[1] if norm_tokens is None else norm_tokens
    return (token_loss * mask).sum() / max(float(n) * float(norm), 1.0)


LOSS_AGG_MODES: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": token_mean,
    "token-sum": token_sum,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}
"""Loss aggregation by ``algorithm.loss_agg_mode`` (and ``algorithm.kl_entropy_agg_mode``)."""


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """(B, T) per-token ``values`` to one number by ``LOSS_AGG_MODES[mode]``.

    ``num_tokens``/``num_seqs``: the whole mini-batch's response tokens and sequences when
    ``values`` is one micro batch of it (None: this tensor's), so that the micro batches' results
    sum to the mini-batch's and their accumulated gradient is the mini-batch's;
    ``norm_tokens``: seq-mean-token-sum-norm's constant.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"aggregation mode ({mode!r}) must be one of {sorted(LOSS_AGG_MODES)}")
    return LOSS_AGG_MODES[mode](values, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_tokens=norm_tokens)


# ---------------------------------------------------------------------------------------------
# the critic


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss, per token (B, T), and whether the clipped branch was taken.

        v_clipped = clip(values, old_values - value_clip, old_values + value_clip)
        loss_t    = 0.5 * max((values - R)^2, (v_clipped - R)^2)           (value_clip None: the first)

    Aggregate it like the policy loss (e.g. ``token_mean(loss, mask)``). The references write
    ``old + clip(values - old, ±c)``, which is the same value but differs from ``values`` by an ulp
    when nothing is clipped; clamping ``values`` itself keeps ``v_clipped == values`` exactly inside
    the range, so the clip fraction counts only tokens that were clipped.
    """
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped * mask, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clipped = torch.clamp(values, old_values - value_clip, old_values + value_clip)
    clipped = (v_clipped - returns).square()
    return 0.5 * torch.max(unclipped, clipped) * mask, (clipped > unclipped) & (mask > 0)


# ---------------------------------------------------------------------------------------------
# composition


def corrected_weights(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, algo: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``CORRECTIONS[algo.correction]``, then ``REJECTIONS[algo.rejection]`` on top: (anchor, w, keep),
    each (B, T); a rejected token's keep and weight are 0."""
    anchor, weight, keep = CORRECTIONS[algo.correction](
        proximal_logprobs,
        behaviour_logprobs,
        mask,
        level=algo.correction_level,
        cap=algo.is_cap,
        low=algo.mis_low,
        high=algo.mis_high,
    )
    if algo.rejection != "none":
        reject = REJECTIONS[algo.rejection](proximal_logprobs - behaviour_logprobs, mask, algo.rejection_threshold)
        keep, weight = keep * reject, weight * reject
    return anchor, weight, keep


def _weight_level(algo: AlgorithmConfig) -> str:
    """Whether the importance weights are one per token or one per sequence."""
    return algo.correction_level if algo.correction in ("tis", "mis") else "token"


def batch_weight_sums(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, algo: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of the corrected importance weights of these rows (``weight_sums``), for
    ``is_batch_normalise`` over a whole mini-batch: sums of its parts add up to its."""
    proximal_logprobs, behaviour_logprobs = proximal_logprobs.float(), behaviour_logprobs.float()
    _, weight, keep = corrected_weights(proximal_logprobs, behaviour_logprobs, mask.to(torch.float32), algo)
    return weight_sums(weight, keep, _weight_level(algo))


def compute_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgorithmConfig,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_tokens: float | None = None,
    weight_totals: tuple | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss ``algo`` (an ``AlgorithmConfig``) names, and its per-token parts.

        anchor, w, keep = CORRECTIONS[algo.correction](pi_prox, mu, mask)
        keep, w         = keep * reject, w * reject       reject = REJECTIONS[algo.rejection](pi_prox - mu)
        w               = w / mean_keep(w)                 algo.is_batch_normalise
        pg_loss         = POLICY_LOSSES[algo.policy_loss](logprobs, anchor, A)     (B, T)
        loss            = LOSS_AGG_MODES[algo.loss_agg_mode](w * pg_loss, keep)

    Computed in fp32 whatever the model's dtype (exp of bf16 log-ratio differences is too coarse).

    Args:
        logprobs: (B, T) log pi_theta, with gradient. proximal_logprobs: (B, T) log pi_prox.
        behaviour_logprobs: (B, T) log mu from the generator. advantages, mask: (B, T).
        num_tokens, num_seqs: the whole batch's response tokens and sequences, when this is one
            micro batch of it (None: this tensor's). norm_tokens: seq-mean-token-sum-norm's constant.
        weight_totals: ``is_batch_normalise``'s (sum, count) of the whole batch's weights
            (``batch_weight_sums``), when this is one micro batch of it (None: this tensor's).

    Returns:
        ``(loss, parts)``: the scalar loss and detached (B, T) tensors for statistics:
        ``weight_raw`` (pi_prox / mu per token, before truncation or masking), ``weight`` (the
        applied w), ``keep`` (mask after masked IS and rejection), ``clipped`` (float 0/1: the ratio was cut
        at its ceiling or floor; not the dual clip), ``clipped_high`` / ``clipped_low`` /
        ``clipped_dual`` (float 0/1, apart: ``asyncrl.learner.policy_losses``), ``log_ratio``
        (log pi_theta - log anchor).
    """
    _check_shapes(
        logprobs,
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
        mask=mask,
    )
    logprobs = logprobs.float()
    proximal_logprobs = proximal_logprobs.detach().float()
    behaviour_logprobs = behaviour_logprobs.detach().float()
    advantages = advantages.detach().float()
    mask = mask.to(torch.float32)

    anchor, weight, keep = corrected_weights(proximal_logprobs, behaviour_logprobs, mask, algo)
    if algo.is_batch_normalise:
        weight = batch_normalised_weights(weight, keep, _weight_level(algo), weight_totals)
    pg_loss, clip = POLICY_LOSSES[algo.policy_loss](
        logprobs,
        anchor,
        advantages,
        mask=mask,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
        tau_pos=algo.sapo_tau_pos,
        tau_neg=algo.sapo_tau_neg,
    )
    loss = aggregate(weight.detach() * pg_loss, keep, algo.loss_agg_mode, num_tokens, num_seqs, norm_tokens)
    with torch.no_grad():
        parts = {
            "weight_raw": _log_weights(proximal_logprobs, behaviour_logprobs, mask, "token").exp(),
            "weight": weight.detach(),
            "keep": keep,
            "clipped": ((clip == CLIP_HIGH) | (clip == CLIP_LOW)).float(),
            "clipped_high": (clip == CLIP_HIGH).float(),
            "clipped_low": (clip == CLIP_LOW).float(),
            "clipped_dual": (clip == CLIP_DUAL).float(),
            "log_ratio": (logprobs - anchor).detach(),
        }
    return loss, parts


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_coef: float = 0.2,
    behaviour_weight_cap: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO objective (section 5.2; see the module docstring), token-mean, with
    float stats: the learner's default loss in one call (for tests and the benchmark).

    It is ``compute_policy_loss`` with correction ``decoupled`` (cap ``behaviour_weight_cap``),
    policy loss ``ppo_clip`` (symmetric ``clip_coef``) and ``token-mean``::

        ratio    = exp(logprobs - proximal_logprobs)            = pi_theta / pi_prox
        pg_loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_coef, 1 + clip_coef))
        w        = min(exp(proximal_logprobs - behaviour_logprobs), behaviour_weight_cap)
        loss     = sum_t(mask_t * w_t * pg_loss_t) / sum_t(mask_t)

    Returns:
        ``(loss, stats)``: ``clipfrac`` (|ratio - 1| > clip_coef), ``ratio_mean``,
        ``behaviour_weight_mean`` / ``behaviour_weight_max`` (w before the cap),
        ``behaviour_capped_frac``, ``behaviour_approx_kl`` (k3 of KL(mu || pi_prox)), ``num_tokens``.
    """
    _check_shapes(
        logprobs,
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
        mask=mask,
    )
    if clip_coef <= 0:
        raise ValueError(f"clip_coef ({clip_coef}) must be > 0")
    if behaviour_weight_cap is not None and behaviour_weight_cap < 1:
        raise ValueError(f"behaviour_weight_cap ({behaviour_weight_cap}) must be >= 1 or None")
    loss, parts = compute_policy_loss(
        logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, _decoupled(clip_coef, behaviour_weight_cap)
    )
    with torch.no_grad():
        mask = mask.to(torch.float32)
        log_w = proximal_logprobs.detach().float() - behaviour_logprobs.detach().float()  # log(pi_prox / mu)
        ratio = parts["log_ratio"].exp()
        raw = log_w.exp()  # unclamped, unmasked: masked tokens are left out below
        valid = mask > 0
        stats = {
            "clipfrac": masked_mean(((ratio - 1.0).abs() > clip_coef).float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "behaviour_weight_mean": masked_mean(raw, mask).item(),
            "behaviour_weight_max": raw[valid].max().item() if bool(valid.any()) else 0.0,
            "behaviour_capped_frac": masked_mean((parts["weight"] < raw).float(), mask).item(),
            "behaviour_approx_kl": masked_mean((raw - 1) - log_w, mask).item(),
            "num_tokens": float(mask.sum().item()),
        }
    return loss, stats


@functools.cache
def _decoupled(clip_coef: float, cap: float | None) -> AlgorithmConfig:
    """The ``AlgorithmConfig`` of ``decoupled_ppo_loss`` (built once per setting)."""
    return AlgorithmConfig(
        correction="decoupled",
        policy_loss="ppo_clip",
        loss_agg_mode="token-mean",
        clip_low=clip_coef,
        clip_high=clip_coef,
        is_cap=cap,
    )
