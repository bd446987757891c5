"""One learner step as a short sequence of named stages (``train_step``).

1. ``collate_step``: the groups' shaped rewards and the padded batch; under truncation mode
   ``mask`` the truncated rows' tokens are out of the loss, and so are the tokens the buffer
   found too stale (``Sample.trained_from``; a row with none left is not a sequence of the loss).
2. ``reference_logprobs``: log pi_ref of every response token, when there is a KL reference,
   by the policy's micro batches (packed rows when the policy's are; so are the critic's passes).
3. ``write_advantages``: the advantages into the batch (per sequence from the groups; per
   token from the critic for ``gae``), less the KL penalty when it is in the reward; then the
   teacher's per-token term of on-policy distillation (``asyncrl.learner.distill``).
4. ``proximal_logprobs``: pi_prox, the policy before the step's first update, computed once by a
   no-grad forward pass when the step takes several updates; with one update that update's own
   forward pass gives it (``logprobs.detach()``) and the step is exactly the single-update form.
5. ``update``, ``ppo_epochs`` times over the ``mini_batch_bounds``: per micro batch the forward
   pass (``trainer.score``), the loss (``micro_loss``: the corrected policy loss, the entropy
   bonus, the KL term) and its backward; then one optimizer update.
6. ``step_stats``: the step's figures (``asyncrl.learner.step_stats``); ``version += 1``.

Mini-batches are runs of whole groups in batch order, the same each epoch, as verl cuts them
(OpenRLHF reshuffles each epoch); a group is never split, so group statistics stay within one
update. Each micro batch's loss is its token-sum divided by the token count of the *whole*
mini-batch (and its sequences), so the accumulated gradient is exactly that of the mini-batch's
loss, independent of how it is cut into micro batches; with one mini-batch, that of the batch.
Only the last micro batch of an update is an accumulation boundary
(``asyncrl.learner.deepspeed_setup``).

With several learner ranks (``learner.ranks``) every rank runs this on the whole batch, cut by
``asyncrl.learner.sharding.shard_plan``: what is a statistic of the batch is computed from all of
it on every rank, the forward and backward passes run on the rank's own whole groups, each rank's
loss is scaled by the number of ranks (DeepSpeed averages the gradients, the sum is the one-rank
gradient), rows that other ranks scored (the reference's logprobs, the critic's advantages) are
summed into every rank's batch, and the step's figures are gathered from every rank. DeepSpeed's
collectives run once per forward and backward pass, so a rank with fewer micro batches in an
update than another runs empty ones (``fillers``: a real row whose loss is multiplied by 0, so
its gradient is exactly 0) until the counts agree.

With sequence parallelism (``learner.sequence_parallel: N``) the batch is cut over the
data-parallel ranks (``dp.data_world``), and the N ranks of a sequence-parallel group run the same
micro batches, each on its shard of the positions (``asyncrl.learner.ulysses``): each computes
the whole micro batch's loss from the group's gathered scores, the loss is still scaled by the
number of all ranks (the shards' gradients sum to the rows'), and per-row results and figures are
counted once, from the group's first rank.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncrl.learner.advantages import reinforce_pp_token_advantages
from asyncrl.learner.batch import TrainBatch, collate, fully_masked
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.critic import critic_advantages
from asyncrl.learner.distill import add_distillation
from asyncrl.learner.group_advantages import shaped_rewards, weighted_advantages
from asyncrl.learner.kl import KL_ESTIMATORS
from asyncrl.learner.logprobs import TokenScores
from asyncrl.learner.losses import aggregate, batch_weight_sums, compute_policy_loss, log_linear_proximal_logprobs
from asyncrl.learner.packing import MicroBatchPlan, plan_micro_batches
from asyncrl.learner.reference import micro_logprobs
from asyncrl.learner.sharding import ShardPlan, shard_plan
from asyncrl.learner.step_stats import add_micro_figures, merge_rank_figures, step_stats
from asyncrl.learner.truncation import is_truncated
from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.schema import Group

if TYPE_CHECKING:
    from asyncrl.learner.trainer_parts import TrainerParts


@dataclass
class StepInputs:
    """What every update of a step shares; none of it changes within the step."""

    batch: TrainBatch
    """The padded batch, its advantages written (on the CPU)."""
    in_loss: torch.Tensor
    """(B,) bool: rows whose tokens are in the loss (not truncated rows under truncation mode mask)."""
    proximal: torch.Tensor | None
    """(B, L-1) log pi_prox, when the step takes several updates; None: each update's own."""
    ref: torch.Tensor | None
    """(B, L-1) log pi_ref, or None without a KL reference."""
    beta: float
    """The KL coefficient for this step."""
    norm_tokens: int
    """seq-mean-token-sum-norm's constant."""
    version_before: int
    """The learner's version before the step (pi_prox's)."""
    shards: ShardPlan
    """The batch's mini-batches and each rank's rows of them (one rank: all of them)."""
    weight_totals: torch.Tensor | None = None
    """(B, 2): each row's mini-batch's (sum, count) of importance weights, under
    ``algorithm.is_batch_normalise`` (``importance_weight_totals``); None otherwise."""


def train_step(trainer: TrainerParts, groups: list[Group], weights=None) -> StepStats:
    """One learner step of ``trainer`` on ``groups`` (see ``PolicyTrainer.train_step``)."""
    start = time.perf_counter()
    algo, dp = trainer.algo, trainer.dp
    version_before = trainer.version
    beta = trainer.kl_controller.value
    shards = shard_plan(groups, trainer.mini_batches, dp.data_world)
    groups = [groups[i] for i in shards.order]  # each rank's share of a mini-batch: one run of rows
    if weights is not None and len(weights) == len(groups):  # a wrong count: weighted_advantages names it
        weights = [weights[i] for i in shards.order]
    batch, shaped, truncated = collate_step(algo, groups, trainer.pad_id)
    in_loss = ~truncated if algo.truncation.mode == "mask" else torch.ones_like(truncated)  # (B,)
    in_loss &= ~fully_masked(groups)  # no token within the staleness bound: dropped, not a sequence of loss 0
    ref = reference_logprobs(trainer, batch, shards)  # (B, L-1) or None
    critic_stats = write_advantages(trainer, batch, groups, shaped, ref, weights, beta, shards)
    add_distillation(algo, batch, groups, weights)  # the teacher's per-token term (algorithm.distill)
    several_updates = len(shards.minis) * trainer.ppo_epochs > 1
    # batch-normalised importance weights need pi_prox of the whole mini-batch before its update
    needs_proximal = several_updates or algo.is_batch_normalise
    proximal = proximal_logprobs(trainer, batch, shards) if needs_proximal else None
    norm_tokens = algo.loss_norm_tokens or int(batch.response_mask.sum(dim=1).max().item())
    totals = importance_weight_totals(trainer, batch, shards, proximal) if algo.is_batch_normalise else None
    step = StepInputs(batch, in_loss, proximal, ref, beta, norm_tokens, version_before, shards, totals)

    epochs = []
    with dp.collective("train step", version_before):  # DeepSpeed's gradient collectives
        for _ in range(trainer.ppo_epochs):
            sums: Counter = Counter()
            for index in range(len(shards.minis)):
                update(trainer, step, index, sums)
            epochs.append(sums)
    # a sequence-parallel group's ranks hold the same figures: its first rank's count once
    own = epochs if dp.seq_lead else [Counter() for _ in epochs]
    epochs = merge_rank_figures(dp.all_gather(own, "step figures", version_before))
    trainer.version += 1
    stats = step_stats(
        batch,
        groups,
        epochs,
        shaped,
        truncated,
        in_loss,
        critic_stats,
        version_before=version_before,
        version=trainer.version,
        updates=trainer.updates,
        grad_clip=trainer.cfg.grad_clip,
        penalise=algo.truncation.mode == "penalise",
        with_reference=trainer.reference is not None,
    )
    if trainer.reference is not None:
        stats.kl_coef = beta
        trainer.kl_controller.update(stats.ref_kl, n_samples=len(batch))
    stats.step_s = time.perf_counter() - start
    return stats


def collate_step(
    algo: AlgorithmConfig, groups: list[Group], pad_id: int
) -> tuple[TrainBatch, list[np.ndarray], torch.Tensor]:
    """The step's padded batch (advantages still 0), its shaped rewards (one row per group) and
    which rows were truncated, (B,) bool; under truncation mode ``mask`` those rows' tokens
    are out of the loss (and still in their group's baseline)."""
    shaped = shaped_rewards(algo, groups)
    batch = collate(groups, [np.zeros(len(g.samples), dtype=np.float32) for g in groups], pad_id)
    truncated = torch.from_numpy(np.concatenate([is_truncated(g) for g in groups]))  # (B,) in collate's order
    if algo.truncation.mode == "mask":
        batch.response_mask[truncated] = 0.0
    return batch, shaped, truncated


def mini_batch_bounds(groups: list[Group], mini_batches: int) -> list[tuple[int, int]]:
    """Row ranges of the step's mini-batches: ``mini_batches`` runs of whole groups, in batch
    order, as equal in groups as they can be (fewer when the batch has fewer groups)."""
    offsets = np.cumsum([0] + [len(g.samples) for g in groups])
    parts = np.array_split(np.arange(len(groups)), min(mini_batches, len(groups)))
    return [(int(offsets[p[0]]), int(offsets[p[-1] + 1])) for p in parts]


def micro_plans(trainer: TrainerParts, batch: TrainBatch, lo: int, hi: int) -> list[MicroBatchPlan]:
    """Rows ``lo:hi`` cut into micro batches (``micro_batch_size`` sequences, or packed to
    ``micro_batch_tokens``: ``asyncrl.learner.packing``), their ``lo``/``hi`` rows of ``batch``."""
    if hi <= lo:
        return []
    cfg = trainer.cfg
    lengths = batch.attention_mask[lo:hi].sum(dim=1).tolist()
    plans = plan_micro_batches(lengths, cfg.micro_batch_size, cfg.micro_batch_tokens, trainer.row_tokens)
    for plan in plans:
        plan.lo, plan.hi = plan.lo + lo, plan.hi + lo
    return plans


def padded_plans(
    trainer: TrainerParts, batch: TrainBatch, ranges: list[list[tuple[int, int]]], filler_row: int
) -> list[tuple[MicroBatchPlan, bool]]:
    """This rank's micro batches of its ``ranges[rank]`` (``ranges[r]``: rank r's row ranges),
    then fillers (``True``: the plan of row ``filler_row``) until it has as many as the rank with
    the most: every rank then enters DeepSpeed's per-pass collectives equally often. A filler runs
    the real row's forward (every module and parameter takes part, as ZeRO's hooks expect) and its
    loss is multiplied by 0. Every rank computes every rank's plans: they are functions of the
    whole batch, which every rank has."""
    rank = trainer.dp.data_rank
    counts = [sum(len(micro_plans(trainer, batch, lo, hi)) for lo, hi in rank_ranges) for rank_ranges in ranges]
    own = [(plan, False) for lo, hi in ranges[rank] for plan in micro_plans(trainer, batch, lo, hi)]
    filler = micro_plans(trainer, batch, filler_row, filler_row + 1)[0]
    return own + [(filler, True)] * (max(counts) - len(own))


def reference_logprobs(trainer: TrainerParts, batch: TrainBatch, shards: ShardPlan) -> torch.Tensor | None:
    """log pi_ref of every response token, (B, L-1) on the CPU (0 off the response), by the
    policy's micro batches (packed when its are: ``reference.micro_logprobs``), each rank its own
    rows, summed into every rank's; None without a reference.

    A ``collective`` reference (partitioned under ZeRO-3) gathers in every forward pass: a rank
    with fewer micro batches than another runs filler passes (``padded_plans``), whose results it
    drops. Any other reference's forward is local: no fillers."""
    if trainer.reference is None:
        return None
    dp = trainer.dp
    ranges = [shards.own(r) for r in range(dp.data_world)]
    if trainer.reference.collective:
        plans = padded_plans(trainer, batch, ranges, filler_row=0)
        if not dp.seq_lead:  # under sequence parallelism the group's first rank fills in its rows
            plans = [(plan, True) for plan, _ in plans]
    else:  # under sequence parallelism the group's first rank scores its rows whole (not sharded)
        own = ranges[dp.data_rank] if dp.seq_lead else []
        plans = [(plan, False) for lo, hi in own for plan in micro_plans(trainer, batch, lo, hi)]
    out = torch.zeros_like(batch.behaviour_logprobs)
    with torch.no_grad():
        for plan, filler in plans:
            micro = batch.slice(plan.lo, plan.hi).to(trainer.device)
            ref = micro_logprobs(trainer.reference, micro, plan, trainer.pad_id, trainer.distribution)  # (b, l-1)
            if not filler:
                out[plan.lo : plan.hi, : ref.shape[1]] = ref.cpu()
    return trainer.dp.all_sum(out, "reference logprobs", trainer.version)


def write_advantages(
    trainer: TrainerParts, batch: TrainBatch, groups, shaped, ref, weights, beta, shards: ShardPlan
) -> dict:
    """Each sequence's advantage into ``batch.advantages`` (per token for gae): from the shaped
    rewards, less beta * KL(mu, ref) summed over the sequence when ``kl.use_in`` is reward,
    scaled by the groups' importance weights. Returns the critic's stats (gae), else {}.

    From the whole batch on every rank; the critic's passes run on each rank's own rows
    (``critic.critic_advantages`` sums them into every rank's batch)."""
    algo = trainer.algo
    rewards = shaped
    if ref is not None and algo.kl.use_in == "reward" and algo.adv_estimator != "gae":  # gae: per token
        kl = KL_ESTIMATORS[algo.kl.estimator](batch.behaviour_logprobs, ref)  # (B, L-1)
        seq_kl = (kl * batch.response_mask).sum(dim=1).numpy()  # (B,)
        offsets = np.cumsum([0] + [len(g.samples) for g in groups])
        rewards = [r - beta * seq_kl[offsets[i] : offsets[i + 1]] for i, r in enumerate(rewards)]
    if algo.adv_estimator == "gae":
        dp = trainer.dp
        # the policy's micro batches (packed when its are), fillers last: every rank runs as many critic passes
        planned = padded_plans(trainer, batch, [shards.own(r) for r in range(dp.world)], filler_row=0)
        plans = [plan for plan, _ in planned]
        micro_refs = [
            None if ref is None else ref[p.lo : p.hi, : batch.slice(p.lo, p.hi).response_mask.shape[1]] for p in plans
        ]
        return critic_advantages(
            trainer.critic,
            algo,
            batch,
            plans,
            np.concatenate(rewards),
            micro_refs,
            weights,
            beta,
            policy_logprobs=lambda micro, plan: trainer.score(micro.to(trainer.device), False, plan).logprobs.cpu(),
            fillers=sum(filler for _, filler in planned),
            dp=dp,
            version=trainer.version,
        )
    if per_token_returns(algo, batch):
        batch.advantages[:] = reinforce_pp_per_token(algo, groups, batch, rewards, weights)
        return {}
    rows = weighted_advantages(algo, groups, weights, rewards)
    batch.advantages[:] = torch.from_numpy(np.concatenate(rows).astype(np.float32))[:, None]
    return {}


def per_token_returns(algo: AlgorithmConfig, batch: TrainBatch) -> bool:
    """REINFORCE++ with token whitening on a batch with per-token rewards: each token's own return."""
    reinforce = algo.adv_estimator in ("reinforce_pp", "reinforce_pp_baseline")
    return reinforce and algo.reinforce_pp_whitening == "token" and bool(batch.token_rewards.any())


def reinforce_pp_per_token(algo: AlgorithmConfig, groups, batch: TrainBatch, rewards, weights) -> torch.Tensor:
    """(B, L-1) REINFORCE++ advantages from each token's return (``reinforce_pp_token_advantages``),
    the group mean taken out first for the baseline variant, scaled by the groups' importance weights."""
    if algo.adv_estimator == "reinforce_pp_baseline":
        rewards = [r - r.mean() for r in rewards]
    returns = torch.from_numpy(np.concatenate(rewards).astype(np.float32))
    adv = reinforce_pp_token_advantages(
        returns, batch.token_rewards, batch.response_mask, unbiased=algo.std_estimator == "unbiased"
    )
    if weights is not None:
        adv = adv * torch.as_tensor(np.asarray(weights, np.float32))[batch.group_index][:, None]
    return adv


def proximal_logprobs(trainer: TrainerParts, batch: TrainBatch, shards: ShardPlan) -> torch.Tensor:
    """log pi_prox, (B, L-1) on the CPU: the current policy's logprobs of this rank's response
    tokens (0 on other ranks' rows, which it never trains on) by a no-grad forward pass in micro
    batches (the same forward the updates run), before any update of the step.

    Every update of the step takes its ratio and clip against these (the decoupled
    objective's proximal policy; plain PPO's old policy), as PPO does over epochs. With
    ``algorithm.proximal: log_linear`` they are the same: its interpolation between mu and
    pi_theta at the proximal version gives pi_theta itself, and the step's updates make no
    published version to interpolate towards.
    """
    out = torch.zeros_like(batch.behaviour_logprobs)
    ranges = [shards.own(r) for r in range(trainer.dp.data_world)]
    trainer.engine.train()  # the mode of the updates' forward passes (dropout, if any)
    with torch.no_grad(), trainer.dp.collective("proximal logprobs", trainer.version):
        for plan, filler in padded_plans(trainer, batch, ranges, filler_row=0):
            micro = batch.slice(plan.lo, plan.hi).to(trainer.device)
            logprobs = trainer.score(micro, entropy=False, plan=plan).logprobs  # (b, l-1)
            if not filler:
                out[plan.lo : plan.hi, : logprobs.shape[1]] = logprobs.cpu()
    return out


def importance_weight_totals(
    trainer: TrainerParts, batch: TrainBatch, shards: ShardPlan, proximal: torch.Tensor
) -> torch.Tensor:
    """(B, 2): each row's mini-batch's (sum, count) of corrected importance weights
    (``losses.batch_weight_sums``), from every rank's rows of it (``proximal`` holds this rank's
    rows only), so batch normalisation divides every micro batch on every rank by the mean of
    the whole mini-batch, as one rank on the whole mini-batch would."""
    own = torch.zeros(len(shards.minis), 2, dtype=torch.float64)  # (M, 2)
    for mini, share in enumerate(shards.shares):
        lo, hi = share[trainer.dp.data_rank]
        if hi > lo and trainer.dp.seq_lead:  # a sequence-parallel group's rows counted once
            rows = (proximal[lo:hi], batch.behaviour_logprobs[lo:hi], batch.response_mask[lo:hi])
            own[mini] = torch.stack(batch_weight_sums(*rows, trainer.algo)).double()
    totals = trainer.dp.all_sum(own, "importance weight sums", trainer.version)
    out = torch.zeros(len(batch), 2, dtype=torch.float64)
    for mini, (lo, hi) in enumerate(shards.minis):
        out[lo:hi] = totals[mini]
    return out


def update(trainer: TrainerParts, step: StepInputs, mini: int, sums: Counter) -> None:
    """One optimizer update on mini-batch ``mini`` (this rank's rows of it): forward/backward by
    micro batches, gradients accumulated (over the ranks too), then the step; its figures are
    added to ``sums``.

    The normalisers are the whole mini-batch's, on every rank; each rank's loss is scaled by the
    number of ranks, as DeepSpeed averages the ranks' gradients (``asyncrl.learner.sharding``)."""
    batch, world = step.batch, trainer.dp.world
    lo, hi = step.shards.minis[mini]
    total_tokens = max(int(batch.response_mask[lo:hi].sum().item()), 1)
    num_seqs = int(step.in_loss[lo:hi].sum())
    plans = padded_plans(trainer, batch, [[share] for share in step.shards.shares[mini]], filler_row=lo)
    trainer.engine.train()
    update_loss = 0.0
    for index, (plan, filler) in enumerate(plans):
        micro = batch.slice(plan.lo, plan.hi).to(trainer.device)
        # Only the last micro batch is an accumulation boundary: ZeRO-1/2 hand the summed
        # gradients to the optimizer partitions there, not after every micro batch.
        trainer.engine.set_gradient_accumulation_boundary(index == len(plans) - 1)
        scores = trainer.score(micro, entropy=True, plan=plan)
        loss, policy_loss, parts, entropy_sum, kl_sum = micro_loss(
            trainer.algo, step, plan, micro, scores, total_tokens, num_seqs
        )
        if filler:  # its forward and backward keep the collectives in step; it trains nothing
            backward(trainer, loss * 0.0)
            continue
        backward(trainer, loss * world if world > 1 else loss)
        if kl_sum is not None:
            sums["ref_kl_sum"] += float(kl_sum.detach())
        update_loss += add_micro_figures(
            sums, micro, plan, scores, parts, loss, policy_loss, entropy_sum, step.version_before
        )
    lr, grad_norm = trainer.optimizer_update()
    sums["lr"] = lr
    sums.setdefault("grad_norms", []).append(grad_norm)
    sums.setdefault("update_losses", []).append(update_loss)


def backward(trainer: TrainerParts, loss: torch.Tensor) -> None:
    """The micro batch's backward (its scaling is the caller's); under sequence parallelism
    inside the attention's exchange scope, which gradient checkpointing's recomputation needs."""
    if trainer.sequence is None:
        trainer.engine.backward(loss, scale_wrt_gas=False)
        return
    with trainer.sequence.backward_scope():
        trainer.engine.backward(loss, scale_wrt_gas=False)


def micro_loss(
    algo: AlgorithmConfig,
    step: StepInputs,
    plan: MicroBatchPlan,
    micro: TrainBatch,
    scores: TokenScores,
    total_tokens: int,
    num_seqs: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """One micro batch's share of its mini-batch's loss, normalised by the mini-batch's
    ``total_tokens`` and ``num_seqs``:

        loss = policy loss (``compute_policy_loss``) - entropy_coef * agg(H)
               + beta * agg(KL(pi_theta, pi_ref))              (when ``kl.use_in`` is loss)

    agg: ``aggregate`` by ``kl_entropy_agg_mode`` (None: ``loss_agg_mode``) over the same
    mini-batch normalisers as the policy loss.

    Returns ``(loss, policy_loss, parts, entropy_sum, kl_sum)``: ``parts`` the policy loss's
    per-token parts, ``kl_sum`` None without a reference.
    """
    a, b = plan.lo, plan.hi
    mask = micro.response_mask  # (b, l-1)
    width = mask.shape[1]
    logprobs = scores.logprobs  # (b, l-1)
    if step.proximal is not None:
        prox = step.proximal[a:b, :width].to(logprobs.device)
    elif algo.proximal == "log_linear":
        prox = log_linear_proximal_logprobs(
            micro.behaviour_logprobs, logprobs, micro.behaviour_version, step.version_before, step.version_before
        )
    else:  # the step's only update: the current policy is the proximal one (ratio == 1)
        prox = logprobs.detach()
    policy_loss, parts = compute_policy_loss(
        logprobs,
        prox,
        micro.behaviour_logprobs,
        micro.advantages,
        mask,
        algo,
        num_tokens=total_tokens,
        num_seqs=num_seqs,
        norm_tokens=step.norm_tokens,
        weight_totals=None if step.weight_totals is None else tuple(step.weight_totals[a]),
    )
    loss = policy_loss
    entropy = scores.entropy if algo.entropy_coef > 0 else scores.entropy.detach()  # (b, l-1)
    entropy_sum = (entropy * mask).sum()
    agg = (algo.kl_entropy_agg_mode or algo.loss_agg_mode, total_tokens, num_seqs, step.norm_tokens)
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * aggregate(entropy, mask, *agg)
    kl_sum = None
    if step.ref is not None:
        kl = KL_ESTIMATORS[algo.kl.estimator](logprobs, step.ref[a:b, :width].to(logprobs.device))  # (b, l-1)
        kl_sum = (kl * mask).sum()
        if algo.kl.use_in == "loss":
            loss = loss + step.beta * aggregate(kl, mask, *agg)
    return loss, policy_loss, parts, entropy_sum, kl_sum
