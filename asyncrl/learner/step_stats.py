"""The figures of one learner step: summed per micro batch, then turned into the step's stats.

``add_micro_figures`` adds one micro batch's sums (losses, tokens, kept and clipped tokens,
importance weights, KL estimates, entropy, padding) to its epoch's ``Counter``; ``step_stats``
turns the epochs' sums into the ``StepStats`` ``PolicyTrainer.train_step`` returns (its fields, in
``asyncrl.observability.step_stats``, say what each is). pi_prox and mu do not change within a step, so the importance-weight figures are those of
one pass (the first epoch); the others are over every update.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from asyncrl.learner.batch import TrainBatch, fully_masked
from asyncrl.learner.logprobs import TokenScores
from asyncrl.learner.packing import MicroBatchPlan
from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.schema import Group


@torch.no_grad()
def add_micro_figures(
    sums: Counter,
    micro: TrainBatch,
    plan: MicroBatchPlan,
    scores: TokenScores,
    parts: dict[str, torch.Tensor],
    loss: torch.Tensor,
    policy_loss: torch.Tensor,
    entropy_sum: torch.Tensor,
    version_before: int,
) -> float:
    """Add one micro batch's figures to ``sums``; return its total loss as a float.

    ``parts``: ``compute_policy_loss``'s per-token parts; ``entropy_sum``: the micro batch's
    entropy summed over its response tokens; ``version_before``: the learner's version before the
    step (staleness 0 marks the sampler/learner mismatch tokens).
    """
    mask = micro.response_mask  # (b, l-1)
    sums["policy_loss"] += float(policy_loss.detach())
    sums["tokens"] += float(mask.sum())
    sums["slots_used"] += plan.tokens
    sums["slots"] += plan.capacity
    sums["entropy_sum"] += float(entropy_sum.detach())
    sums["outside"] += float((scores.outside * mask).sum())
    keep, w, raw = parts["keep"], parts["weight"], parts["weight_raw"]
    sums["kept"] += float(keep.sum())
    sums["clipped"] += float((parts["clipped"] * keep).sum())
    for side in ("high", "low", "dual"):
        sums[f"clipped_{side}"] += float((parts[f"clipped_{side}"] * keep).sum())
    log_ratio = parts["log_ratio"]  # log pi_theta - log anchor
    sums["approx_kl_sum"] += float((((log_ratio.exp() - 1) - log_ratio) * keep).sum())
    sums["ppo_kl_sum"] += float((-log_ratio * keep).sum())
    sums["w_sum"] += float((w * mask).sum())
    sums["w_sq_sum"] += float((w.square() * mask).sum())
    sums["raw_sum"] += float((raw * mask).sum())
    sums["raw_sq_sum"] += float((raw.square() * mask).sum())
    k3 = (raw - 1) - raw.log()  # (b, l-1) per-token k3 of KL(mu || pi_prox)
    sums["behaviour_kl_sum"] += float((k3 * mask).sum())
    add_kl_by_staleness(sums, k3, mask, version_before - micro.behaviour_version)  # per token
    fresh = mask * (micro.behaviour_version == version_before).to(mask.dtype)  # (b, l-1): sampled by pi_prox's version
    sums["fresh_tokens"] += float(fresh.sum())
    sums["mismatch_kl_sum"] += float((k3 * fresh).sum())
    if bool((mask > 0).any()):
        sums["is_weight_max"] = max(sums["is_weight_max"], float(raw[mask > 0].max()))
    return float(loss.detach())


def add_kl_by_staleness(sums: Counter, k3: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor) -> None:
    """Add the k3 KL sums and token counts of each staleness (rows (b,), or tokens (b, l-1)) to
    ``sums`` as ``kl_sum@d`` and ``kl_tokens@d``: what ``buffer.max_staleness: auto`` reads."""
    if staleness.dim() == 1:
        staleness = staleness[:, None].expand_as(mask)
    staleness = staleness[..., : mask.shape[-1]]
    for d in torch.unique(staleness[mask > 0]).tolist():
        at = mask * (staleness == d).to(mask.dtype)
        sums[f"kl_sum@{d}"] += float((k3 * at).sum())
        sums[f"kl_tokens@{d}"] += float(at.sum())


def kl_by_staleness(sums: Counter) -> dict[int, float]:
    """Staleness -> mean k3 KL(mu ‖ pi_prox) per token, from ``add_kl_by_staleness``'s sums."""
    out = {}
    for key in sums:
        if key.startswith("kl_tokens@") and sums[key] > 0:
            d = key.split("@", 1)[1]
            out[int(d)] = sums[f"kl_sum@{d}"] / sums[key]
    return dict(sorted(out.items()))


def merge_rank_figures(ranks: list[list[Counter]]) -> list[Counter]:
    """Each epoch's figures from every learner rank (``ranks[r]``: rank r's epochs) as one rank's
    would be on the whole batch: sums summed, ``is_weight_max`` the largest, ``update_losses``
    summed update by update (each rank's is its share of the update's loss), ``lr`` and
    ``grad_norms`` rank 0's (every rank takes the same update on the same reduced gradient)."""
    if len(ranks) == 1:
        return ranks[0]
    merged = []
    for parts in zip(*ranks):
        out: Counter = Counter()
        for key in sorted(set().union(*parts)):
            values = [part[key] for part in parts if key in part]
            if key == "is_weight_max":
                out[key] = max(values)
            elif key in ("lr", "grad_norms"):
                out[key] = parts[0][key]
            elif key == "update_losses":
                out[key] = [sum(losses) for losses in zip(*values)]
            else:
                out[key] = sum(values)
        merged.append(out)
    return merged


def step_stats(
    batch: TrainBatch,
    groups: list[Group],
    epochs: list[Counter],
    shaped: list[np.ndarray],
    truncated: torch.Tensor,
    in_loss: torch.Tensor,
    critic_stats: dict,
    *,
    version_before: int,
    version: int,
    updates: int,
    grad_clip: float,
    penalise: bool,
    with_reference: bool,
) -> StepStats:
    """The step's stats (``StepStats``) from each epoch's sums.

    ``shaped``: the shaped rewards (the overlong penalty is their mean excess over the task's
    reward, when ``penalise``); ``truncated``, ``in_loss``: (B,) bool; ``critic_stats``: the
    critic's figures (gae), else {}; ``version``/``updates``: after the step; ``with_reference``:
    whether a KL reference was used (then ``ref_kl``)."""
    first = epochs[0]
    tokens = sum(e["tokens"] for e in epochs)
    kept = sum(e["kept"] for e in epochs)
    total_tokens = max(batch.num_tokens, 1)
    losses = [loss for e in epochs for loss in e["update_losses"]]
    policy_losses = sum(e["policy_loss"] for e in epochs)
    trained_rows = ~fully_masked(groups)  # (B,) rows with a token in the loss
    staleness = (version_before - batch.policy_version)[trained_rows].tolist()
    stats = StepStats(
        version=version,
        updates=updates,
        loss=float(np.mean(losses)),
        policy_loss=policy_losses / len(losses),
        lr=epochs[-1]["lr"],
        **clip_stats([n for e in epochs for n in e["grad_norms"]], grad_clip),
        clipfrac=sum(e["clipped"] for e in epochs) / max(kept, 1.0),
        clipfrac_high=sum(e["clipped_high"] for e in epochs) / max(kept, 1.0),
        clipfrac_low=sum(e["clipped_low"] for e in epochs) / max(kept, 1.0),
        clipfrac_dual=sum(e["clipped_dual"] for e in epochs) / max(kept, 1.0),
        approx_kl=sum(e["approx_kl_sum"] for e in epochs) / max(kept, 1.0),
        ppo_kl=sum(e["ppo_kl_sum"] for e in epochs) / max(kept, 1.0),
        is_weight_mean=first["raw_sum"] / total_tokens,
        is_weight_max=first["is_weight_max"],
        is_weight_ess=first["w_sum"] ** 2 / max(total_tokens * first["w_sq_sum"], 1e-12),
        masked_frac=1.0 - first["kept"] / total_tokens if batch.num_tokens else 0.0,
        behaviour_kl=first["behaviour_kl_sum"] / total_tokens,
        behaviour_ess=first["raw_sum"] ** 2 / max(total_tokens * first["raw_sq_sum"], 1e-12),
        behaviour_kl_by_staleness=kl_by_staleness(first),
        mismatch_kl=first["mismatch_kl_sum"] / first["fresh_tokens"] if first["fresh_tokens"] else float("nan"),
        entropy=sum(e["entropy_sum"] for e in epochs) / max(tokens, 1.0),
        outside_truncation_frac=sum(e["outside"] for e in epochs) / max(tokens, 1.0),
        padding_frac=1.0 - sum(e["slots_used"] for e in epochs) / max(sum(e["slots"] for e in epochs), 1.0),
        staleness=staleness,
        token_staleness=token_staleness(batch, version_before),
        stale_tokens_masked=sum(s.trained_from for g in groups for s in g.samples),
        stale_samples_masked=int((~trained_rows).sum()),
        staleness_mean=float(np.mean(staleness)) if staleness else float("nan"),
        staleness_max=int(max(staleness, default=0)),
        reward=float(np.mean([s.reward for g in groups for s in g.samples])),
        truncated_frac=float(truncated.float().mean()),
        sequences=int(in_loss.sum()),
        tokens=batch.num_tokens,
        **critic_stats,
    )
    if len(losses) > 1:
        stats.loss_by_update = losses
        stats.grad_norm_by_update = [n for e in epochs for n in e["grad_norms"]]
    if len(epochs) > 1:
        stats.clipfrac_by_epoch = [e["clipped"] / max(e["kept"], 1.0) for e in epochs]
        stats.approx_kl_by_epoch = [e["approx_kl_sum"] / max(e["kept"], 1.0) for e in epochs]
    if penalise:
        task = np.concatenate([[s.reward for s in g.samples] for g in groups])
        stats.overlong_penalty = float(np.mean(np.concatenate(shaped) - task))
    if with_reference:
        stats.ref_kl = sum(e["ref_kl_sum"] for e in epochs) / max(tokens, 1.0)
    return stats


def token_staleness(batch: TrainBatch, version_before: int) -> dict[int, int]:
    """Response tokens in the loss by staleness, ``version_before`` minus the version that sampled
    each (``behaviour_version``): a sample spanning a weight update counts each segment at its own."""
    lags = (version_before - batch.behaviour_version)[batch.response_mask > 0]  # (tokens,)
    values, counts = np.unique(lags.numpy(), return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}


def clip_stats(grad_norms: list[float], grad_clip: float) -> dict:
    """Gradient clipping over a step's updates: ``grad_norm`` (mean norm before clipping),
    ``grad_norm_max``, ``grad_clipped`` (share of updates clipped) and ``grad_clip_coef`` (mean
    factor the gradient was scaled by, min(1, grad_clip / norm); 1 when nothing was clipped)."""
    norms = np.asarray(grad_norms, dtype=np.float64)
    if grad_clip > 0:
        coef = np.minimum(1.0, grad_clip / np.maximum(norms, 1e-12))
    else:
        coef = np.ones_like(norms)
    return {
        "grad_norm": float(norms.mean()),
        "grad_norm_max": float(norms.max()),
        "grad_clipped": float((coef < 1.0).mean()),
        "grad_clip_coef": float(coef.mean()),
    }
