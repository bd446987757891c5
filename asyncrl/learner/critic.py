"""The critic of PPO with GAE: a value model in its own DeepSpeed engine.

The value model is the policy's transformer backbone (loaded from the same model directory, so
it starts from the policy's features) with a zero-initialised scalar head: V(s_t) for every
position. It has its own optimizer and engine, so it never shares a gradient or a step with the
policy. ``CriticTrainer.advantages_and_step`` does, per micro batch, a forward pass with
gradient, computes the targets from its own (detached) values (``gae_advantages``, or
``vtrace_targets`` when the samples' staleness should be corrected), backpropagates the clipped
value loss, and takes one optimizer step for the batch; it returns the per-token advantages for
the policy's update.

``critic_advantages`` is the policy step's side of it: the token rewards (with the KL penalty
when ``kl.use_in`` is reward), V-trace's log(pi_prox / mu), one critic step, then the
advantages written into the batch, optionally whitened (``whiten_tokens``), scaled by each
group's importance weight.

Alignment as in ``batch.py``: ``values[:, t]`` is V of the state at position t, the state in
which ``input_ids[:, t + 1]`` is chosen, so values line up with ``response_mask``.

The critic's passes run the policy's micro batches: packed several sequences to a row when
``learner.trainer.micro_batch_tokens`` packs the policy's (``asyncrl.learner.packing``), the
values moved back to the padded layout on the response tokens (``CriticTrainer.values``; GAE,
V-trace and the value loss read no value off them), and the backbone runs the learner's
attention implementation (``learner.trainer.attn_implementation``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from asyncrl.learner.advantages import gae_advantages, vtrace_targets
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.config import AlgorithmConfig, CriticConfig, TrainerConfig
from asyncrl.learner.data_parallel import DataParallel
from asyncrl.learner.deepspeed_setup import deepspeed_engine, init_learner_group
from asyncrl.learner.kl import KL_ESTIMATORS
from asyncrl.learner.losses import value_loss
from asyncrl.learner.offload import adamw_optimizer
from asyncrl.learner.packing import MicroBatchPlan, pack
from asyncrl.learner.partitioned_load import build_partitioned, load_partitioned, zero_partitioned


class ValueModel(torch.nn.Module):
    """A causal LM backbone and a linear head to one value per position: (B, L) ids -> (B, L)."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        self.backbone.config.use_cache = False
        hidden = self.backbone.config.hidden_size
        self.v_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.v_head.weight)
        torch.nn.init.zeros_(self.v_head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Packed rows come with ``position_ids`` restarting per sequence and no attention mask
        (Hugging Face then keeps attention within each sequence, ``asyncrl.learner.packing``)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1).float()  # (B, L)


def build_value_model(model_dir: str | Path, cfg: TrainerConfig) -> ValueModel:
    """The value model of ``model_dir``: the causal LM's own backbone (its ``base_model``,
    without the LM head it is saved with) and a zero head. Under ZeRO-3 built partitioned and
    loaded module by module (``partitioned_load``), the head zeroed across the ranks."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    attn = cfg.attn_implementation
    if cfg.zero_stage < 3:
        causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
        return ValueModel(causal_lm.base_model)
    config = AutoConfig.from_pretrained(model_dir)
    model = build_partitioned(
        lambda: ValueModel(AutoModel.from_config(config, dtype=torch.float32, attn_implementation=attn)), cfg
    )
    # The checkpoint names the backbone's parameters under the causal LM's prefix ("model.").
    missing = load_partitioned(model.backbone, model_dir, prefix=model.backbone.base_model_prefix + ".")
    if missing:
        raise ValueError(
            f"{model_dir}: the checkpoint lacks {missing[:5]} ({len(missing)} tensors) of the value model's backbone"
        )
    zero_partitioned(list(model.v_head.parameters()))  # its init was skipped with the backbone's
    return model


def whiten_tokens(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """(values - mean) / (std + eps) over the tokens where ``mask`` is 1, 0 elsewhere; (B, T).

    The variance divides by the token count N, or by N - 1 when ``unbiased``
    (``algorithm.std_estimator``; verl's ``masked_whiten`` is unbiased, OpenRLHF's population).
    """
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    var = ((values - mean) * mask).square().sum() / (n - 1 if unbiased else n).clamp(min=1)
    return (values - mean) / (var.sqrt() + eps) * mask


def token_rewards(batch: TrainBatch, rewards: torch.Tensor) -> torch.Tensor:
    """(B, L-1) rewards r_t for GAE and V-trace: each sample's per-token rewards where it has
    them (``TrainBatch.token_rewards``: a reward function's per-token scores, on trained tokens),
    and the rest of its reward, ``rewards`` minus their sum, on its last trained token; 0 elsewhere.
    The row sums are ``rewards``, so the undiscounted return is the sequence's reward either way;
    per-token rewards change only which tokens are credited with it."""
    mask = batch.response_mask
    positions = torch.arange(mask.shape[1]).expand_as(mask)  # (B, L-1)
    last = (positions * (mask > 0)).amax(dim=1)  # (B,) index of the last trained token
    placed = batch.token_rewards.to(mask.dtype) * mask
    out = placed.clone()
    out[torch.arange(mask.shape[0]), last] += rewards.to(out.dtype) - placed.sum(dim=1)
    return out * mask


class CriticTrainer:
    """The value model's DeepSpeed engine; one optimizer step per batch, like the policy."""

    def __init__(self, model_dir: str | Path, cfg: CriticConfig, trainer_cfg: TrainerConfig, pad_id: int = 0):
        if not torch.distributed.is_initialized():
            init_learner_group(trainer_cfg.collective_timeout_s)
        self.cfg = cfg
        self.pad_id = pad_id
        """The token id after the last sequence of a packed row."""
        model = build_value_model(model_dir, trainer_cfg)
        if trainer_cfg.gradient_checkpointing:
            model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        # the critic's own rate and decay (torch's default decay is 0.01), the policy's betas and offload
        optimizer = adamw_optimizer(model.parameters(), trainer_cfg, cfg.lr, cfg.weight_decay)
        self.engine = deepspeed_engine(model, optimizer, trainer_cfg, role="critic")
        self.device = self.engine.device

    def values(self, micro: TrainBatch, plan: MicroBatchPlan | None = None) -> torch.Tensor:
        """(b, l-1) V(s_t) of a micro batch (on the engine's device), with gradient: on its packed
        rows when ``plan`` packs them, moved back to the padded layout on the response tokens (0
        elsewhere); else on its padded rows."""
        if plan is None or plan.placement is None:
            return self.engine(micro.input_ids, micro.attention_mask)[:, :-1]
        rows = pack(micro.input_ids, micro.attention_mask, micro.response_mask, plan, self.pad_id)
        packed = self.engine(rows.input_ids, None, rows.position_ids)[:, :-1]  # (R, C-1)
        return rows.unpack(packed, micro.response_mask)

    def advantages_and_step(
        self,
        micro_batches: list[TrainBatch],
        token_rewards_per_micro: list[torch.Tensor],
        log_rhos_per_micro: list[torch.Tensor | None],
        total_tokens: int,
        world: int = 1,
        fillers: int = 0,
        plans: list[MicroBatchPlan] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        """Train the critic one step on the batch; return each micro batch's (b, l-1) advantages.

        ``plans[i]``: how micro batch i's forward is laid out (packed or padded rows, ``values``);
        None: all padded.
        ``log_rhos_per_micro[i]`` (log pi_prox - log mu) selects V-trace for that micro batch;
        None: GAE. The value loss is token-mean over the whole batch's ``total_tokens``; with
        ``world`` learner ranks each rank's share is scaled by it (DeepSpeed averages the ranks'
        gradients), so the sum over ranks is the whole batch's loss. The last ``fillers`` micro
        batches only keep the ranks' collectives in step: their loss is multiplied by 0 and they
        add nothing to the stats.
        """
        cfg = self.cfg
        self.engine.train()
        advantages, stats = [], {"value_loss": 0.0, "value_clipfrac": 0.0, "value_mean": 0.0, "return_mean": 0.0}
        for index, (micro, rewards, log_rhos) in enumerate(
            zip(micro_batches, token_rewards_per_micro, log_rhos_per_micro)
        ):
            micro = micro.to(self.device)
            mask = micro.response_mask
            self.engine.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
            values = self.values(micro, None if plans is None else plans[index])  # (b, l-1)
            old = values.detach()
            rewards = rewards.to(self.device)
            if log_rhos is None:
                adv, returns = gae_advantages(rewards, old, mask, cfg.gamma, cfg.lam)
            else:
                returns, adv = vtrace_targets(rewards, old, log_rhos.to(self.device), mask, cfg.gamma)
            per_token, clipped = value_loss(values, old, returns, mask, cfg.value_clip)
            loss = per_token.sum() / total_tokens
            if index >= len(micro_batches) - fillers:
                self.engine.backward(loss * 0.0, scale_wrt_gas=False)
                advantages.append(adv.detach())
                continue
            self.engine.backward(loss * world if world > 1 else loss, scale_wrt_gas=False)
            advantages.append(adv.detach())
            stats["value_loss"] += loss.item()
            stats["value_clipfrac"] += clipped.float().sum().item() / total_tokens
            stats["value_mean"] += (old * mask).sum().item() / total_tokens
            stats["return_mean"] += (returns * mask).sum().item() / total_tokens
        self.engine.step()
        return advantages, stats


def critic_advantages(
    critic: CriticTrainer,
    algo: AlgorithmConfig,
    batch: TrainBatch,
    plans: list[MicroBatchPlan],
    rewards: np.ndarray,
    ref_logprobs: list[torch.Tensor | None],
    weights,
    beta: float,
    policy_logprobs: Callable[[TrainBatch, MicroBatchPlan], torch.Tensor],
    fillers: int = 0,
    dp: DataParallel | None = None,
    version: int = 0,
) -> dict:
    """Per-token advantages from the critic (one critic step), written into ``batch.advantages``.

    ``plans``: the batch's micro batches (rows ``lo:hi``, packed or padded: the policy's);
    ``rewards``: (B,) one shaped reward per sequence; ``ref_logprobs``: the reference's logprobs
    per micro batch (None without one); ``weights``: one importance weight per group, or None;
    ``policy_logprobs(micro, plan)``: the policy's (b, l-1) logprobs of a micro batch on the
    CPU, without gradient.

    Token rewards: the outcome reward on the last response token, minus beta * KL(mu, ref) on
    every token when ``kl.use_in`` is reward. V-trace targets use log(pi_prox / mu) from a
    no-grad forward pass of the policy. Then optional whitening over the batch's response
    tokens, and each group's importance weight. Returns the critic's stats.

    With several learner ranks (``dp``) ``plans`` are this rank's micro batches, the last
    ``fillers`` of them only there so that every rank runs as many critic passes (their loss is
    multiplied by 0, their advantages dropped); the advantages of every rank's rows are summed
    into every rank's batch before the whitening, and the stats summed over the ranks.
    """
    dp = dp if dp is not None else DataParallel()
    micros = [batch.slice(plan.lo, plan.hi) for plan in plans]
    token_rewards_list, log_rhos = [], []
    for plan, micro, ref in zip(plans, micros, ref_logprobs):
        r = token_rewards(micro, torch.from_numpy(rewards[plan.lo : plan.hi]))  # (b, l-1)
        if ref is not None and algo.kl.use_in == "reward":
            r = r - beta * KL_ESTIMATORS[algo.kl.estimator](micro.behaviour_logprobs, ref.cpu()) * micro.response_mask
        token_rewards_list.append(r)
        if algo.critic.targets == "vtrace":
            with torch.no_grad():
                lp = policy_logprobs(micro, plan)
            log_rhos.append((lp - micro.behaviour_logprobs) * micro.response_mask)
        else:
            log_rhos.append(None)
    total_tokens = max(batch.num_tokens, 1)
    with dp.collective("critic step", version):
        advantages, stats = critic.advantages_and_step(
            micros, token_rewards_list, log_rhos, total_tokens, dp.world, fillers, plans
        )
    batch.advantages.zero_()
    for plan, adv in list(zip(plans, advantages))[: len(plans) - fillers]:
        batch.advantages[plan.lo : plan.hi, : adv.shape[1]] = adv.cpu()
    dp.all_sum(batch.advantages, "critic advantages", version)
    ranks = dp.all_gather(stats, "critic figures", version)
    stats = {key: sum(s[key] for s in ranks) for key in stats}
    mask = batch.response_mask
    if algo.critic.whiten_advantages:
        batch.advantages.copy_(whiten_tokens(batch.advantages, mask, algo.std_estimator == "unbiased"))
    if weights is not None:
        w = torch.as_tensor(np.asarray(weights, dtype=np.float32).reshape(-1))
        if w.numel() != int(batch.group_index.max()) + 1 or not bool(torch.isfinite(w).all() and (w >= 0).all()):
            raise ValueError(f"weights ({w.tolist()}) must be finite, >= 0 and one per group")
        batch.advantages.mul_(w[batch.group_index][:, None])
    return stats
