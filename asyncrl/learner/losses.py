"""Policy losses. Each is a pure function of (B, T) token tensors returning (loss, stats).

The learner trains on samples that generators drew with older weights: a group in the buffer can
be k optimizer steps old by the time it is trained on. The decoupled PPO objective of AReaL
(Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning", section 5.2; Hilton et al. 2022, "Batch size-invariance for policy optimization")
separates the two policies PPO's single "old policy" conflates:

- the *behaviour* policy mu, which sampled the tokens (the generator's weights, k versions old);
- the *proximal* policy pi_prox, the trust-region centre that the update is clipped around
  (the learner's current weights before this update).

Clipping around pi_prox keeps each update small relative to where the learner is now, however
stale the data; the importance weight pi_prox / mu corrects for the data coming from mu.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1; 0 (not NaN) when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_coef: float = 0.2,
    behaviour_weight_cap: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Staleness-corrected GRPO policy loss: AReaL's decoupled PPO objective, token-mean.

    Per response token t, with advantage A (the sample's GRPO advantage)::

        ratio    = exp(logprobs - proximal_logprobs)            = pi_theta / pi_prox
        pg_loss1 = -A * ratio
        pg_loss2 = -A * clip(ratio, 1 - clip_coef, 1 + clip_coef)
        w        = min(exp(proximal_logprobs - behaviour_logprobs), behaviour_weight_cap)
                                                                = pi_prox / mu, truncated, no gradient
        loss_t   = w * max(pg_loss1, pg_loss2)
        loss     = sum_t(mask_t * loss_t) / sum_t(mask_t)

    Why: a sample may be k policy versions old, sampled by mu = pi_{theta_{v-k}}. PPO's clipped
    surrogate keeps the update inside a trust region around pi_prox, the learner's current policy
    before this update, not around the stale mu (clipping around mu would freeze learning on stale
    data, and would let a step move far from where the learner is). The off-policyness between
    mu and pi_prox is corrected by the importance weight w. It is detached (a weight on the
    surrogate, not a term to optimise) and truncated at ``behaviour_weight_cap`` (truncated
    importance sampling, as in IMPALA/V-trace; AReaL instead drops tokens above its cap): a token
    mu sampled that pi_prox finds far likelier would otherwise dominate the batch's gradient.
    ``None`` disables the cap.

    When the learner takes one optimizer step per batch, pi_prox is exactly pi_theta at the
    forward pass, so the trainer passes ``proximal_logprobs = logprobs.detach()``: ratio == 1, no
    token is clipped, and the gradient is that of -w * A * log pi_theta. A second forward pass for
    pi_prox is needed only when one batch is split into several optimizer steps.

    Args:
        logprobs: (B, T) log pi_theta of the sampled tokens, with gradient.
        proximal_logprobs: (B, T) log pi_prox of the same tokens (no gradient needed).
        behaviour_logprobs: (B, T) log mu, as reported by the generator that sampled them.
        advantages: (B, T) per-token advantages (the sample's advantage on each of its tokens).
        mask: (B, T) 1 on response tokens that count, 0 on prompt and padding.
        clip_coef: epsilon of PPO's clip, > 0.
        behaviour_weight_cap: truncate w at this value (>= 1), or None for no truncation.

    Returns:
        ``(loss, stats)``: the scalar loss, and floats over the masked tokens: ``clipfrac``
        (fraction of tokens with |ratio - 1| > clip_coef), ``ratio_mean``,
        ``behaviour_weight_mean`` / ``behaviour_weight_max`` (w before the cap),
        ``behaviour_capped_frac`` (fraction of tokens whose w was truncated),
        ``behaviour_approx_kl`` (k3 estimate of KL(mu || pi_prox) = E_mu[(w - 1) - log w], >= 0),
        ``num_tokens``.
    """
    shape = logprobs.shape
    for name, value in (
        ("proximal_logprobs", proximal_logprobs),
        ("behaviour_logprobs", behaviour_logprobs),
        ("advantages", advantages),
        ("mask", mask),
    ):
        if value.shape != shape:
            raise ValueError(f"{name} shape {tuple(value.shape)} must equal logprobs shape {tuple(shape)}")
    if clip_coef <= 0:
        raise ValueError(f"clip_coef ({clip_coef}) must be > 0")
    if behaviour_weight_cap is not None and behaviour_weight_cap < 1:
        raise ValueError(f"behaviour_weight_cap ({behaviour_weight_cap}) must be >= 1 or None")

    # Compute in fp32 whatever the model's dtype: exp() of bf16 log-ratio differences is too coarse.
    logprobs = logprobs.float()
    proximal_logprobs = proximal_logprobs.detach().float()
    behaviour_logprobs = behaviour_logprobs.detach().float()
    advantages = advantages.detach().float()
    mask = mask.to(torch.float32)

    logratio = logprobs - proximal_logprobs  # (B, T)
    ratio = logratio.exp()  # (B, T)
    pg_loss1 = -advantages * ratio  # (B, T)
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)  # (B, T)
    pg_loss = torch.max(pg_loss1, pg_loss2)  # (B, T)

    behaviour_logratio = proximal_logprobs - behaviour_logprobs  # (B, T)
    behaviour_weight = behaviour_logratio.exp()  # (B, T), pi_prox / mu, no gradient
    if behaviour_weight_cap is not None:
        capped_weight = behaviour_weight.clamp(max=behaviour_weight_cap)  # (B, T)
    else:
        capped_weight = behaviour_weight

    loss = masked_mean(capped_weight * pg_loss, mask)

    with torch.no_grad():
        valid = mask > 0
        any_valid = bool(valid.any())
        stats = {
            "clipfrac": masked_mean(((ratio - 1.0).abs() > clip_coef).float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "behaviour_weight_mean": masked_mean(behaviour_weight, mask).item(),
            "behaviour_weight_max": behaviour_weight[valid].max().item() if any_valid else 0.0,
            "behaviour_capped_frac": masked_mean((capped_weight < behaviour_weight).float(), mask).item(),
            # k3 estimator (Schulman, "Approximating KL divergence"): unbiased and >= 0 per token.
            "behaviour_approx_kl": masked_mean((behaviour_weight - 1) - behaviour_logratio, mask).item(),
            "num_tokens": float(mask.sum().item()),
        }
    return loss, stats


LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "decoupled_ppo": decoupled_ppo_loss,
}
"""Policy losses by name, for the trainer's config; each has ``decoupled_ppo_loss``'s signature."""
