"""Online DPO on the stream: one learner step of a preference loss on pairs drawn from each group.

With ``algorithm.objective: online_dpo`` the learner trains the groups the buffer hands it as
preference pairs instead of by policy gradient (``PolicyTrainer.train_step`` dispatches here):

1. ``select_pairs``: each group's answers ranked by reward (the rewards the policy gradient would
   see, the overlong penalty included): its best against its worst (``dpo.pairs: best_worst``,
   the first of equal answers, which in a group of i.i.d. answers is a uniform choice), or every
   best against every worst (``all``). A group whose best does not beat its worst by more than
   ``dpo.min_reward_gap`` (ties: every answer scored alike) gives no pair and trains nothing;
   the step counts it (``dpo_groups_unpaired``). Answers out of the loss (truncated ones under
   truncation mode ``mask``, answers with every token past the staleness bound) are not paired.
2. The paired answers, as groups of their own, are the step's batch: cut into mini-batches and
   across learner ranks by whole groups (``asyncrl.learner.sharding``), so a pair never straddles
   two updates or two ranks; each answer once, however many pairs it is in.
3. log pi_ref of each answer from the frozen starting weights, through the learner's reference
   (``algorithm.kl.reference``: colocated or its own process; ``step.reference_logprobs``).
4. Per update, two passes over the mini-batch's micro batches (``step.padded_plans``, so packing,
   micro batches and ranks work as for the policy gradient):

   - a no-grad pass gives S_i, each answer's token log-probabilities under the sampling
     distribution (``trainer.score``) summed over its trained tokens; s_i = log pi_theta(y_i|x) is
     S_i, or S_i / T_i (its token count) with ``dpo.length_normalise``. The mini-batch's loss is
     ``L = sum_p w_p [loss(s_chosen(p), s_rejected(p), ref...) - nll_coef S_chosen(p) / T_chosen(p)] / P``
     (``preference_loss``; the second term RPO's, off by default; w_p the pair's group's
     importance weight, P the mini-batch's pairs on every rank), and its derivative per answer,
     c_i = dL/dS_i, is one scalar;
   - a pass with gradient backpropagates ``sum_i c_i S_i(theta)``, whose gradient is exactly
     ``sum_i (dL/dS_i) grad S_i = grad L``.

   The chosen and rejected answers of a pair may sit in different micro batches (or packed rows),
   and DPO's loss does not split into per-answer terms, so the first pass's scalars join them;
   the price is one no-grad forward per update (~1/3 of a forward and backward). The passes must
   compute the same function: the learner's models have no dropout (a model with dropout would
   take the gradient at a slightly different sample of it). Then one optimizer update, as for the
   policy gradient. A batch without a pair takes no update; the version still advances.

Staleness. The pairs were sampled by older policies (up to ``buffer.max_staleness`` learner steps
before the step that trains them). DPO's loss is a function of the two answers' log-probabilities
under pi_theta and pi_ref only: it needs no behaviour probabilities, so a stale pair is as valid
a term of the objective as a fresh one and no importance correction is taken (none is needed for
the objective to be the one DPO defines). What staleness changes is *which* answers are
compared: the pairs come from older policies' distribution, not the current one's, which is the
difference between offline and online DPO. Guo et al. 2024 ("Direct Language Model Alignment
from Online AI Feedback", OAIF) attribute online DPO's gain to sampling pairs from the policy
being trained; Noukhovitch et al. 2024 ("Asynchronous RLHF") trained online DPO on pairs up to
several updates old and found it the most robust of the online methods to such off-policy data.
So ``buffer.max_staleness`` is the knob: it bounds how many learner steps old the sampling
policy of every trained pair is (older groups are dropped by the buffer, reason ``stale``), and
with it how far the pairs' distribution may have drifted from the current policy's. The step
reports that age as for the policy gradient (``staleness_mean``, ``staleness_max``).
``buffer.max_staleness: auto`` is refused: it steers by the policy gradient's importance weights,
which this step does not compute.

Priority weights. A prioritized buffer's importance weights (``buffer.beta`` > 0) correct the bias
of sampling groups by priority rather than uniformly; that bias is in which groups are trained,
whatever the loss, so each pair's loss is multiplied by its group's weight, as a group's policy
loss is. The priorities themselves (``buffer.priority``) work unchanged: ``reward_variance``
favours groups with a spread of rewards, the ones that give a pair; ``mean_abs_advantage`` reads
``algorithm.adv_estimator``'s advantages (the estimator trains nothing here).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncrl.learner.batch import TrainBatch, collate, fully_masked
from asyncrl.learner.config import OnlineDPOConfig
from asyncrl.learner.group_advantages import shaped_rewards
from asyncrl.learner.preference_losses import preference_loss
from asyncrl.learner.sharding import ShardPlan, shard_plan
from asyncrl.learner.step import padded_plans, reference_logprobs
from asyncrl.learner.step_stats import clip_stats, merge_rank_figures, token_staleness
from asyncrl.learner.truncation import is_truncated
from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.schema import Group, episode_parts

if TYPE_CHECKING:
    from asyncrl.learner.trainer_parts import TrainerParts


def select_pairs(
    rewards: np.ndarray, pairs: str = "best_worst", min_reward_gap: float = 0.0, eligible: np.ndarray | None = None
) -> list[tuple[int, int]]:
    """(chosen, rejected) indices of one group's answers by ``rewards`` (n,): the best against the
    worst (``best_worst``: the first of equal ones) or every best against every worst (``all``),
    among the ``eligible`` answers (None: all); none when the best does not exceed the worst by
    more than ``min_reward_gap``.

    >>> select_pairs(np.array([0.0, 1.0, 1.0, 0.0]))
    [(1, 0)]
    >>> select_pairs(np.array([0.0, 1.0, 1.0, 0.0]), "all")
    [(1, 0), (1, 3), (2, 0), (2, 3)]
    >>> select_pairs(np.array([1.0, 1.0, 1.0]))
    []
    """
    if pairs not in ("best_worst", "all"):
        raise ValueError(f"pairs {pairs!r} must be 'best_worst' or 'all'")
    index = np.arange(len(rewards)) if eligible is None else np.flatnonzero(eligible)
    if len(index) < 2:
        return []
    r = np.asarray(rewards, dtype=np.float64)[index]
    best, worst = r.max(), r.min()
    if not best - worst > min_reward_gap:
        return []
    if pairs == "best_worst":
        return [(int(index[np.argmax(r)]), int(index[np.argmin(r)]))]
    return [(int(c), int(w)) for c in index[r == best] for w in index[r == worst]]


@dataclass
class PairBatch:
    """The step's pairs: the paired answers as groups of their own, and the pairs as row indices."""

    groups: list[Group]
    """One per group with a pair: the group with only its paired answers (chosen ones first)."""
    pairs: list[list[tuple[int, int]]]
    """``pairs[g]``: (chosen, rejected) indices into ``groups[g].samples``."""
    weights: list[float]
    """The importance weight of each group (1 without a prioritized buffer's weights)."""
    unpaired: int
    """Groups of the batch that gave no pair."""


def pair_batch(
    groups: list[Group], rewards: list[np.ndarray], eligible: list[np.ndarray], cfg: OnlineDPOConfig, weights=None
) -> PairBatch:
    """The pairs of every group (``select_pairs`` on its ``rewards`` row among its ``eligible``
    answers), each group with a pair cut down to its paired answers."""
    if weights is not None and len(weights) != len(groups):
        raise ValueError(f"weights has {len(weights)} entries, must have one per group ({len(groups)})")
    out = PairBatch([], [], [], 0)
    for g, group in enumerate(groups):
        if episode_parts(group) is not None:
            raise ValueError(
                f"group {group.group_id}: an episode split into parts has no single sequence log-probability; "
                "algorithm.objective 'online_dpo' needs whole episodes"
            )
        chosen_rejected = select_pairs(rewards[g], cfg.pairs, cfg.min_reward_gap, eligible[g])
        if not chosen_rejected:
            out.unpaired += 1
            continue
        keep = list(dict.fromkeys([c for c, _ in chosen_rejected] + [r for _, r in chosen_rejected]))
        row = {old: new for new, old in enumerate(keep)}
        out.groups.append(dataclasses.replace(group, samples=[group.samples[i] for i in keep]))
        out.pairs.append([(row[c], row[r]) for c, r in chosen_rejected])
        out.weights.append(1.0 if weights is None else float(weights[g]))
    return out


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, normalise: bool) -> torch.Tensor:
    """(B, L-1) token log-probabilities -> (B,) each row's sum over its ``mask``-ed tokens, or
    their mean with ``normalise`` (0 for a row with none)."""
    total = (token_logprobs * mask).sum(dim=1)
    return total / mask.sum(dim=1).clamp(min=1) if normalise else total


@dataclass
class PairStep:
    """What every update of an online DPO step shares."""

    batch: TrainBatch
    """The paired answers, padded (advantages unused)."""
    shards: ShardPlan
    """Mini-batches and each rank's rows of them (whole groups)."""
    chosen: torch.Tensor
    """(P,) row of each pair's chosen answer."""
    rejected: torch.Tensor
    """(P,) row of each pair's rejected answer."""
    weight: torch.Tensor
    """(P,) the pair's group's importance weight."""
    ref: torch.Tensor
    """(B,) log pi_ref of each answer (summed or averaged as ``normalise``)."""


def online_dpo_step(trainer: TrainerParts, groups: list[Group], weights=None) -> StepStats:
    """One learner step of online DPO on ``groups`` (see the module docstring); ``weights``: one
    importance weight per group (None: all 1). Every rank calls it with the same whole batch."""
    start = time.perf_counter()
    algo, dp, cfg = trainer.algo, trainer.dp, trainer.algo.dpo
    version_before = trainer.version
    rewards = shaped_rewards(algo, groups)
    out_of_loss = fully_masked(groups).numpy()  # (B,) every token past the staleness bound
    offsets = np.cumsum([0] + [len(g.samples) for g in groups])
    eligible = []
    for g, group in enumerate(groups):
        ok = ~out_of_loss[offsets[g] : offsets[g + 1]]
        if algo.truncation.mode == "mask":
            ok &= ~is_truncated(group)
        eligible.append(ok)
    paired = pair_batch(groups, rewards, eligible, cfg, weights)
    truncated = np.concatenate([is_truncated(g) for g in groups])
    sums: list[Counter] = []
    if paired.groups:
        step = prepare(trainer, paired)
        with dp.collective("online DPO step", version_before):
            for _ in range(trainer.ppo_epochs):
                epoch: Counter = Counter()
                for mini in range(len(step.shards.minis)):
                    update(trainer, step, mini, epoch)
                sums.append(epoch)
        sums = merge_rank_figures(dp.all_gather(sums, "step figures", version_before))
    trainer.version += 1
    stats = pair_stats(paired, sums, groups, truncated, version_before, trainer.version, trainer.updates, trainer.cfg)
    stats.step_s = time.perf_counter() - start
    return stats


def prepare(trainer: TrainerParts, paired: PairBatch) -> PairStep:
    """The step's batch of paired answers, cut by whole groups, and their reference log-probabilities."""
    shards = shard_plan(paired.groups, trainer.mini_batches, trainer.dp.world)
    groups = [paired.groups[i] for i in shards.order]
    pairs = [paired.pairs[i] for i in shards.order]
    weights = [paired.weights[i] for i in shards.order]
    batch = collate(groups, [np.zeros(len(g.samples), dtype=np.float32) for g in groups], trainer.pad_id)
    offsets = np.cumsum([0] + [len(g.samples) for g in groups])
    chosen = [offsets[g] + c for g, group_pairs in enumerate(pairs) for c, _ in group_pairs]
    rejected = [offsets[g] + r for g, group_pairs in enumerate(pairs) for _, r in group_pairs]
    weight = [weights[g] for g, group_pairs in enumerate(pairs) for _ in group_pairs]
    ref_tokens = reference_logprobs(trainer, batch, shards)  # (B, L-1)
    if ref_tokens is None:
        raise ValueError("algorithm.objective 'online_dpo' needs the reference policy: the trainer has none")
    return PairStep(
        batch=batch,
        shards=shards,
        chosen=torch.as_tensor(chosen, dtype=torch.long),
        rejected=torch.as_tensor(rejected, dtype=torch.long),
        weight=torch.as_tensor(weight, dtype=torch.float32),
        ref=sequence_logprobs(ref_tokens, batch.response_mask, trainer.algo.dpo.normalise),
    )


def update(trainer: TrainerParts, step: PairStep, mini: int, sums: Counter) -> None:
    """One optimizer update on mini-batch ``mini``: the no-grad pass for every answer's
    log-probability and the loss's derivative by it, then the pass with gradient (module doc)."""
    cfg, batch, world, rank = trainer.algo.dpo, step.batch, trainer.dp.world, trainer.dp.rank
    lo, hi = step.shards.minis[mini]
    own_lo, own_hi = step.shards.shares[mini][rank]
    in_mini = (step.chosen >= lo) & (step.chosen < hi)  # (P,) a pair's rows share a group: one mini-batch
    own = in_mini & (step.chosen >= own_lo) & (step.chosen < own_hi)
    num_pairs = int(in_mini.sum())
    plans = padded_plans(trainer, batch, [[share] for share in step.shards.shares[mini]], filler_row=lo)
    trainer.engine.train()

    sums_theta = torch.zeros(len(batch))  # (B,) token sums of log pi_theta, this rank's answers of the mini-batch
    with torch.no_grad():
        for plan, filler in plans:  # fillers too: ZeRO-3 gathers parameters in every rank's forward
            micro = batch.slice(plan.lo, plan.hi).to(trainer.device)
            scores = trainer.score(micro, entropy=False, plan=plan)
            if not filler:
                sums_theta[plan.lo : plan.hi] = sequence_logprobs(scores.logprobs, micro.response_mask, False).cpu()

    chosen, rejected, weight = step.chosen[own], step.rejected[own], step.weight[own]
    token_sums = sums_theta.clone().requires_grad_(True)
    counts = batch.response_mask.sum(dim=1).clamp(min=1)  # (B,)
    seq = token_sums / counts if cfg.normalise else token_sums
    out = preference_loss(
        seq[chosen], seq[rejected], step.ref[chosen], step.ref[rejected], cfg.beta, cfg.loss_type, cfg.label_smoothing
    )
    losses = out.losses
    if cfg.nll_coef > 0:  # RPO: the chosen answer's token-mean negative log-likelihood
        losses = losses - cfg.nll_coef * token_sums[chosen] / counts[chosen]
    loss = (losses * weight).sum() / max(num_pairs, 1)  # this rank's share of the mini-batch's mean
    loss.backward()
    coef = token_sums.grad  # (B,) dL/dS_i, 0 for answers of other ranks and mini-batches

    for index, (plan, filler) in enumerate(plans):
        micro = batch.slice(plan.lo, plan.hi).to(trainer.device)
        trainer.engine.set_gradient_accumulation_boundary(index == len(plans) - 1)
        scores = trainer.score(micro, entropy=False, plan=plan)
        rows = sequence_logprobs(scores.logprobs, micro.response_mask, False)  # (b,) S_i(theta)
        surrogate = (coef[plan.lo : plan.hi].to(rows.device) * rows).sum()  # its gradient is grad L's share
        if filler:  # keeps the collectives in step; trains nothing
            trainer.engine.backward(surrogate * 0.0, scale_wrt_gas=False)
            continue
        trainer.engine.backward(surrogate * world if world > 1 else surrogate, scale_wrt_gas=False)

    lr, grad_norm = trainer.optimizer_update()
    sums["lr"] = lr
    sums.setdefault("grad_norms", []).append(grad_norm)
    sums.setdefault("update_losses", []).append(float(loss.detach()))
    sums["pairs"] += int(own.sum())
    sums["correct"] += float((out.chosen_rewards > out.rejected_rewards).sum())
    sums["chosen_reward"] += float(out.chosen_rewards.sum())
    sums["rejected_reward"] += float(out.rejected_rewards.sum())


def pair_stats(
    paired: PairBatch,
    epochs: list[Counter],
    groups: list[Group],
    truncated: np.ndarray,
    version_before: int,
    version: int,
    updates: int,
    cfg,
) -> StepStats:
    """The step's ``StepStats``: the DPO figures over every update's pairs, the staleness of the
    answers trained, the batch's reward (every group's, paired or not)."""
    staleness: list[int] = []
    tokens_by_staleness: dict[int, int] = {}
    tokens = 0
    if paired.groups:
        batch = collate(paired.groups, [np.zeros(len(g.samples), dtype=np.float32) for g in paired.groups], 0)
        staleness = (version_before - batch.policy_version).tolist()  # (answers,) as the policy gradient's
        tokens_by_staleness = token_staleness(batch, version_before)
        tokens = batch.num_tokens
    pairs = sum(e["pairs"] for e in epochs)
    losses = [loss for e in epochs for loss in e["update_losses"]]
    grad_norms = [n for e in epochs for n in e["grad_norms"]]
    stats = StepStats(
        version=version,
        updates=updates,
        loss=float(np.mean(losses)) if losses else 0.0,
        tokens=tokens,
        staleness=staleness,
        token_staleness=tokens_by_staleness,
        staleness_mean=float(np.mean(staleness)) if staleness else float("nan"),
        staleness_max=int(max(staleness, default=0)),
        reward=float(np.mean([s.reward for g in groups for s in g.samples])),
        truncated_frac=float(truncated.mean()) if len(truncated) else 0.0,
        sequences=len(staleness),
        dpo_pairs=sum(len(p) for p in paired.pairs),
        dpo_groups_unpaired=paired.unpaired,
    )
    if losses:
        stats.lr = epochs[-1]["lr"]
        stats.loss_by_update = losses if len(losses) > 1 else None
        stats.grad_norm_by_update = grad_norms if len(grad_norms) > 1 else None
        for key, value in clip_stats(grad_norms, cfg.grad_clip).items():
            setattr(stats, key, value)
    if pairs:
        stats.dpo_accuracy = sum(e["correct"] for e in epochs) / pairs
        stats.dpo_chosen_reward = sum(e["chosen_reward"] for e in epochs) / pairs
        stats.dpo_rejected_reward = sum(e["rejected_reward"] for e in epochs) / pairs
        stats.dpo_margin = stats.dpo_chosen_reward - stats.dpo_rejected_reward
    return stats
