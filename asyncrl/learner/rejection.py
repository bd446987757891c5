"""Rejection masks on the train/behaviour mismatch, and batch-normalised importance weights.

Both act on the log-ratio of the learner's proximal policy to the behaviour policy that sampled
the tokens, ``log_ratio = log pi_prox - log mu`` (B, T), on top of the correction
(``algorithm.correction``, ``asyncrl.learner.losses``). With r = pi_prox / mu per token, the
divergence estimates (Schulman 2020, "Approximating KL Divergence") are::

    k2 = (log r)^2 / 2                  (>= 0; its mean under mu approximates KL for small mismatch)
    k3 = r - 1 - log r                  (>= 0, unbiased for KL(mu || pi_prox) under mu)

A rejection mask drops a token, or a whole sequence, whose divergence exceeds a threshold
(``algorithm.rejection``/``rejection_threshold``), rather than truncating its weight: a token
the two policies disagree on that much is a sampler artefact or a stale outlier, and scaling it
keeps a biased gradient (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch", part 3; verl's rollout correction ``rollout_rs``
names these criteria). The sequence criteria reject every token of a sequence together:
``seq_mean_k3`` by the sequence's mean divergence (a geometric, length-independent measure),
``seq_max_k2`` by its worst token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_MAX_LOG_RATIO = 20.0  # the log-ratio is clamped here before exp, as everywhere in the loss


def k2_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """k2 = (log r)^2 / 2 per token, (B, T)."""
    return 0.5 * log_ratio.square()


def k3_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r per token, (B, T); the log-ratio clamped to +-20 before exp."""
    clamped = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return clamped.exp() - 1 - clamped


def _keep_rows(row_ok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool per row -> (B, T) keep mask within ``mask``."""
    return mask * row_ok.to(mask.dtype)[:, None]


def token_k2_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """keep_t = mask_t * 1[k2_t <= threshold]: each token by its own k2."""
    return mask * (k2_divergence(log_ratio) <= threshold).to(mask.dtype)


def token_k3_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """keep_t = mask_t * 1[k3_t <= threshold]: each token by its own k3."""
    return mask * (k3_divergence(log_ratio) <= threshold).to(mask.dtype)


def seq_mean_k3_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """keep_{i,t} = mask_{i,t} * 1[sum_t mask * k3 / |y_i| <= threshold]: whole sequences by their
    mean k3 (a row with no token has mean 0, and nothing to keep)."""
    length = mask.sum(dim=1).clamp(min=1.0)  # (B,)
    mean_k3 = (k3_divergence(log_ratio) * mask).sum(dim=1) / length  # (B,)
    return _keep_rows(mean_k3 <= threshold, mask)


def seq_max_k2_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """keep_{i,t} = mask_{i,t} * 1[max_t (mask * k2) <= threshold]: whole sequences by their
    worst token's k2 (k2 >= 0, so padding's 0 never raises the maximum)."""
    max_k2 = (k2_divergence(log_ratio) * mask).amax(dim=1)  # (B,)
    return _keep_rows(max_k2 <= threshold, mask)


REJECTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "token_k2": token_k2_rejection,
    "token_k3": token_k3_rejection,
    "seq_mean_k3": seq_mean_k3_rejection,
    "seq_max_k2": seq_max_k2_rejection,
}
"""Rejection masks by ``algorithm.rejection``: (log pi_prox - log mu, mask, threshold) -> (B, T) keep."""

SEQUENCE_REJECTIONS = frozenset({"seq_mean_k3", "seq_max_k2"})
"""The criteria that keep or drop whole sequences."""


def weight_sums(weights: torch.Tensor, mask: torch.Tensor, level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of the importance weights in ``mask``: over tokens, or over sequences (each
    row's weight, the mean of its kept tokens', once per row that has any). Sums of parts add
    up to the whole's, so a mini-batch's mean can be gathered from its micro batches and ranks."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level ({level!r}) must be 'token' or 'sequence'")
    mask = mask.to(weights.dtype)
    if level == "token":
        return (weights * mask).sum(), mask.sum()
    tokens = mask.sum(dim=1)  # (B,)
    per_row = (weights * mask).sum(dim=1) / tokens.clamp(min=1.0)  # (B,) each row's weight
    rows = (tokens > 0).to(weights.dtype)
    return (per_row * rows).sum(), rows.sum()


def batch_normalised_weights(
    weights: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    sums: tuple[torch.Tensor | float, torch.Tensor | float] | None = None,
) -> torch.Tensor:
    """Importance weights scaled to mean 1 over the tokens (or sequences) of a batch.

        token:     w_t / (sum_t mask_t w_t / sum_t mask_t)
        sequence:  w_i / mean_{i : |y_i| > 0} w_i          (w_i: sequence i's weight, one per row)

    After truncation (tis) or masking (mis) the weights' mean drifts below 1 and scales the
    whole gradient down with the mismatch; normalising keeps the step size and leaves only the
    weights' relative sizes (verl's ``rollout_is_batch_normalize``; self-normalised importance
    sampling, a little bias for less variance). ``sums``: the batch's ``weight_sums`` when
    ``weights`` is one micro batch of it (the learner's step passes each mini-batch's, over every
    rank); None: this tensor's. A mean below 1e-8 leaves the weights as they are.
    """
    total, count = weight_sums(weights, mask, level) if sums is None else sums
    as_tensor = lambda x: torch.as_tensor(x, dtype=weights.dtype, device=weights.device)  # noqa: E731
    mean = as_tensor(total) / as_tensor(count).clamp(min=1.0)
    return torch.where(mean > 1e-8, weights / mean.clamp(min=1e-8), weights)  # no host sync
