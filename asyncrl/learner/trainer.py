"""The policy trainer: a Hugging Face causal LM in a DeepSpeed engine, one learner step per batch.

``PolicyTrainer.train_step(groups)`` is one iteration of the algorithm the run's ``algorithm``
section names (default: decoupled GRPO): advantages from the groups' rewards
(``ADV_ESTIMATORS``), then ``ppo_epochs`` passes over the batch cut into ``mini_batches``
mini-batches of whole groups, each one forward/backward (in micro batches, their gradients
accumulated) of the corrected policy loss (``compute_policy_loss``) plus the KL and entropy
terms and one optimizer update; then ``version += 1``. ``full_state_dict()`` and
``save_pretrained()`` hand the new weights to the generators.

What the version counts. ``policy_version`` is the learner's step count: one per batch, however
many optimizer updates the step takes (with the defaults, one: then it is the optimizer-step
count). Only a step's final weights are ever published, so the versions a sample can carry are
exactly the learner's steps; staleness (``version at the update - policy_version``), the
buffer's ``max_staleness``, the dispatcher's admission (B groups per version),
``learner.broadcast_every``, ``learner.total_steps`` and ``checkpoint.every_steps`` all count
batches, and keep their meaning whatever ``ppo_epochs`` and ``mini_batches`` are (AReaL and
PRIME-RL count the same way). The learning-rate schedule counts optimizer updates (``updates``).

Several updates per batch (PPO's epochs and mini-batches, Schulman et al. 2017). pi_prox — the
decoupled objective's proximal policy, plain PPO's old policy — is the policy before the step's
first update, computed once by a no-grad forward pass (``proximal_logprobs``); every update's
ratio and clip are taken against it (or against mu, for ``correction: behaviour_ppo``), and the
advantages, the reference's logprobs and the importance weights pi_prox / mu are computed once.
With one update per step there is no extra forward: pi_prox is that update's own logprobs,
detached, and the step is exactly the single-update form. Mini-batches are runs of whole groups
in batch order, the same each epoch, as verl cuts them (OpenRLHF reshuffles each epoch); a
group is never split, so group statistics stay within one update. The critic (``gae``) takes
one update per step.

The KL reference is a frozen copy of the starting weights, run without gradient and without a
DeepSpeed engine, in each rank (``kl.reference: colocated``) or in its own process
(``kl.reference: process``, see ``asyncrl.learner.reference``); it is used only when
``algorithm.kl.coef > 0``. As a reward penalty the per-token KL is taken between the behaviour
logprobs mu and the reference (the policy that sampled the answer, as OpenRLHF does at
experience time), so it needs no extra policy forward pass.

One optimizer update per mini-batch, whatever its size: the DeepSpeed config has
``gradient_accumulation_steps = 1`` and ``train_micro_batch_size_per_gpu = micro_batch_size``, and
``train_step`` owns the accumulation boundary itself: before each micro batch's backward it calls
``engine.set_gradient_accumulation_boundary(is_last_micro_batch)``, calls
``engine.backward(loss, scale_wrt_gas=False)``, and calls ``engine.step()`` once at its end. The
boundary flag tells ZeRO-1/2 when to move the summed gradients into the optimizer's partitions
(and a multi-rank ZeRO-0 when to all-reduce); marking every micro batch a boundary makes stages
1 and 2 drift from a full-batch step, which ``tests/learner/test_trainer.py`` catches. Each
micro batch's loss is its token-sum divided by the token count of the *whole* mini-batch, so the
accumulated gradient is exactly that of the mini-batch's token-mean loss, independent of how it
is cut into micro batches.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from asyncrl.learner.advantages import ADV_ESTIMATORS, BATCH_ESTIMATORS, remax_advantages
from asyncrl.learner.batch import TrainBatch, collate
from asyncrl.learner.config import AlgorithmConfig, TrainerConfig
from asyncrl.learner.kl import KL_ESTIMATORS, make_kl_controller
from asyncrl.learner.logprobs import TokenDistribution, TokenScores, token_scores
from asyncrl.learner.losses import compute_policy_loss, log_linear_proximal_logprobs
from asyncrl.learner.lr_schedule import lr_factor
from asyncrl.learner.packing import MicroBatchPlan, pack, plan_micro_batches
from asyncrl.learner.reference import ColocatedReference, RemoteReference
from asyncrl.learner.truncation import is_truncated, overlong_penalty
from asyncrl.wire.endpoints import free_ports
from asyncrl.wire.schema import Group

# Files of a Hugging Face model dir that ``save_pretrained`` writes itself instead of copying.
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def init_single_process_distributed(backend: str | None = None) -> None:
    """Initialise DeepSpeed's process group for a process that is not launched by a launcher.

    Sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT where unset (a free port), skips the
    CPU shared-memory all-reduce kernel (compiled on first use, 45-120 s, and useless with one
    process), then ``deepspeed.init_distributed``. Idempotent: a second call does nothing.
    ``backend`` defaults to nccl when CUDA is available, else gloo.
    """
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module whose build_shm_op is replaced)

    if torch.distributed.is_initialized() and deepspeed.comm.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_ports(1)[0])
    if os.environ["WORLD_SIZE"] == "1":
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.distributed.is_initialized():
        # A world destroyed by another library in this process (vLLM's in-process engine does
        # when it closes) leaves DeepSpeed's clone of it cached; the new world needs its own.
        import deepspeed.utils.groups

        deepspeed.utils.groups._WORLD_GROUP = None
    deepspeed.init_distributed(dist_backend=backend)


def deepspeed_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainerConfig):
    """A DeepSpeed engine around ``model`` with the run's ZeRO stage, precision and clipping: one
    micro batch per "DeepSpeed step", the caller owns the accumulation boundary (policy and critic
    alike)."""
    import deepspeed

    zero_buckets = {}
    if cfg.zero_bucket_elements is not None:
        zero_buckets = {
            "reduce_bucket_size": cfg.zero_bucket_elements,
            "allgather_bucket_size": cfg.zero_bucket_elements,
        }
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, **zero_buckets},
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


class PolicyTrainer:
    """The learner's model, optimizer and step counter.

    Every rank of a multi-process learner constructs one and calls ``train_step`` with its own
    share of the groups (ZeRO averages gradients over ranks); ``full_state_dict`` and
    ``save_pretrained`` are collective under ZeRO-3 and must be called on every rank.
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainerConfig,
        algo: AlgorithmConfig | None = None,
        reference_address: str | None = None,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
    ):
        # Imported before DeepSpeed's ZeRO-3 machinery runs: their first import must not happen
        # while zero.Init has patched module construction.
        import torch._dynamo  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM

        self.cfg = cfg
        self.algo = algo if algo is not None else AlgorithmConfig()
        self.model_dir = Path(model_dir)
        if ppo_epochs < 1 or mini_batches < 1:
            raise ValueError(f"ppo_epochs ({ppo_epochs}) and mini_batches ({mini_batches}) must be >= 1")
        self.ppo_epochs = ppo_epochs
        """Passes over each batch (``learner.ppo_epochs``)."""
        self.mini_batches = mini_batches
        """Optimizer updates per pass, each on a run of whole groups (``learner.mini_batches``)."""
        self.version = 0
        """Learner steps taken (one per batch, ``ppo_epochs × mini_batches`` optimizer updates
        each); the policy version of the current weights."""
        self.updates = 0
        """Optimizer updates taken: the index of the learning-rate schedule."""
        if cfg.lr_schedule != "constant" and cfg.lr_decay_steps is None:
            raise ValueError(
                f"lr_schedule ({cfg.lr_schedule}) needs lr_decay_steps (the learner sets it from learner.total_steps), got None"
            )
        self.kl_controller = make_kl_controller(self.algo.kl)
        if self.algo.truncation.mode == "penalise" and self.algo.truncation.max_tokens is None:
            raise ValueError(
                "algorithm.truncation.mode (penalise) needs algorithm.truncation.max_tokens "
                "(the learner sets it from sampling.max_tokens), got None"
            )

        if not torch.distributed.is_initialized():
            init_single_process_distributed()
        torch.manual_seed(cfg.seed)

        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        pad_id = getattr(self.hf_config, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(pad_id, list):
            pad_id = pad_id[0]
        # Padding is never attended to nor trained on; any id in the vocabulary will do.
        self.pad_id = int(pad_id) if pad_id is not None else 0

        # The full fp32 model is loaded on each rank, then DeepSpeed casts it (bf16) and, under
        # ZeRO-3, partitions it. Fine for models that fit in host memory once per rank.
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.config.use_cache = False
        if cfg.gradient_checkpointing:
            # Non-reentrant: works under ZeRO-3 and with inputs that need no gradient.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.distribution = TokenDistribution(cfg.temperature, cfg.top_k, cfg.top_p)
        """The generators' sampling distribution, which every token is scored under."""
        # Packed rows: one per micro batch where attention is variable-length (flash-attention),
        # else as long as the longest sequence (``asyncrl.learner.packing``).
        self._row_tokens = cfg.micro_batch_tokens if "flash" in (model.config._attn_implementation or "") else None
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        self.engine = deepspeed_engine(model, optimizer, cfg)
        self._set_lr()  # the first update's rate (warm-up starts below lr)
        self.device = self.engine.device
        self.critic = None
        """The value model's trainer, for ``adv_estimator: gae``; None otherwise."""
        if self.algo.adv_estimator == "gae":
            from asyncrl.learner.critic import CriticTrainer

            self.critic = CriticTrainer(self.model_dir, self.algo.critic, cfg)
        self.reference = None
        """Frozen reference policy for the KL term (the starting weights); None when kl.coef == 0."""
        if self.algo.kl.enabled:
            if self.algo.kl.reference == "process":
                if reference_address is None:
                    raise ValueError("algorithm.kl.reference (process) needs the reference process's address")
                self.reference = RemoteReference(reference_address)
            else:
                dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
                self.reference = ColocatedReference(str(self.model_dir), self.device, dtype, cfg.logits_chunk_tokens)

    # -----------------------------------------------------------------------------------------
    # training

    def shaped_rewards(self, groups: list[Group]) -> list[np.ndarray]:
        """Each group's rewards, one (n_g,) row per group, with the overlong penalty added under
        ``algorithm.truncation.mode: penalise`` (``asyncrl.learner.truncation``)."""
        for group in groups:
            if not group.scored:
                raise ValueError(f"group {group.group_id}: every sample needs a reward before training")
        rewards = [np.asarray([s.reward for s in g.samples], dtype=np.float32) for g in groups]
        truncation = self.algo.truncation
        if truncation.mode == "penalise":
            l_max, l_cache = truncation.interval(truncation.max_tokens)
            rewards = [
                r + overlong_penalty([len(s.response_ids) for s in g.samples], l_max, l_cache, truncation.penalty)
                for r, g in zip(rewards, groups)
            ]
        return rewards

    def advantages(self, groups: list[Group], rewards: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Advantages of each group's samples by ``algorithm.adv_estimator``, one (n_g,) array per group.

        ``rewards``: per-group reward rows to use instead of ``shaped_rewards`` (a KL-penalised
        reward). Groups of equal size are stacked (G, n); group-local estimators also take ragged
        groups.
        """
        if rewards is None:
            rewards = self.shaped_rewards(groups)
        if self.algo.adv_estimator == "remax":  # baseline: the reward of each prompt's greedy answer
            missing = [g.group_id for g in groups if "greedy_reward" not in g.meta]
            if missing:
                raise ValueError(f"groups {missing[:3]} have no meta['greedy_reward'] (generator.greedy_baseline)")
            greedy = [float(g.meta["greedy_reward"]) for g in groups]
            return [remax_advantages(r[None], np.array([b], dtype=np.float32))[0] for r, b in zip(rewards, greedy)]
        # gae's advantages are per token and need the critic (``train_step``); here, for replay
        # priorities, it stands in with the group-centred rewards.
        estimator = ADV_ESTIMATORS["dr_grpo" if self.algo.adv_estimator == "gae" else self.algo.adv_estimator]
        sizes = {len(r) for r in rewards}
        if len(sizes) == 1:
            return list(estimator(np.stack(rewards)))  # (G, n) -> G rows
        if self.algo.adv_estimator in BATCH_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator '{self.algo.adv_estimator}' needs groups of one size, got sizes {sorted(sizes)}"
            )
        return [estimator(r[None])[0] for r in rewards]

    def weighted_advantages(self, groups: list[Group], weights=None, rewards=None) -> list[np.ndarray]:
        """Advantages, each group's row scaled by its weight (a replay buffer's importance
        weight w_g); ``None``: unweighted.

        Scaling group g's advantages by w_g >= 0 is exactly weighting each of its tokens' policy
        loss by w_g: every policy loss is positively homogeneous in A,
        max(-w·A·ratio, -w·A·clip(ratio)) = w·max(-A·ratio, -A·clip(ratio)) (and the dual clip's
        min, GSPO's and CISPO's products alike), and the correction weights and the aggregation
        are untouched; so no loss function needs a weight argument. The KL and entropy terms
        are not scaled: they regularise the policy, not the sampled estimate.
        """
        rows = self.advantages(groups, rewards)
        if weights is None:
            return rows
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if w.size != len(groups):
            raise ValueError(f"weights has {w.size} entries, must have one per group ({len(groups)})")
        if not (np.isfinite(w).all() and (w >= 0).all()):
            raise ValueError(f"weights ({w.tolist()}) must be finite and >= 0")
        return [row * wg for row, wg in zip(rows, w)]

    def train_step(self, groups: list[Group], weights=None) -> dict:
        """One learner step on ``groups``, each group's policy loss scaled by ``weights[g]``
        (importance weights from a prioritized buffer; None: all 1); returns its stats.

        The step, in named parts: the shaped rewards and the padded batch (``_collate``), the
        reference's logprobs (``_reference_logprobs``), the advantages (``_write_advantages``),
        pi_prox (``proximal_logprobs``, only when the step takes several updates), then
        ``ppo_epochs`` passes over ``mini_batches`` mini-batches of whole groups, one optimizer
        update each (``_update``); ``version += 1`` once, at the end.

        Stats (averaged over the step's updates where they change between updates):
        ``version`` (after the step), ``updates`` (optimizer updates taken, all steps), ``loss``
        (the mean over updates of each update's total loss), ``policy_loss``, ``lr`` (the learning
        rate of the step's last update), ``grad_norm``/``grad_norm_max`` (the global gradient norm
        before clipping), ``grad_clipped`` (share of updates clipped) and ``grad_clip_coef`` (the
        mean factor clipping scaled the gradient by, min(1, grad_clip / grad_norm)), ``clipfrac``
        (kept tokens whose clipped branch was taken), ``approx_kl`` (k3 estimate of KL between the
        ratio's anchor and pi_theta, over kept tokens: 0 for the first update of a step),
        ``clipfrac_by_epoch``/``approx_kl_by_epoch`` (lists, when ``ppo_epochs > 1``),
        ``loss_by_update``/``grad_norm_by_update`` (lists, when the step takes several updates),
        ``is_weight_mean``/``is_weight_max`` (pi_prox / mu per token, before truncation),
        ``is_weight_ess`` (effective sample size of the applied weights over response tokens,
        (sum w)^2 / (N sum w^2), in (0, 1]), ``masked_frac`` (response tokens dropped by the
        correction), ``behaviour_kl`` (k3 estimate of KL(mu || pi_prox) over all tokens),
        ``mismatch_kl`` (the same over tokens of staleness 0 only: sampler/learner mismatch at one
        version; NaN when there are none), ``entropy`` (token-mean entropy of pi_theta),
        ``outside_truncation_frac`` (response tokens outside pi_theta's top-k/top-p set, scored as
        ``asyncrl.learner.logprobs`` says; 0 without top-k/top-p), ``padding_frac`` (padding /
        token slots of the micro batches' forward passes, packed or not; ``asyncrl.learner.packing``),
        ``ref_kl`` and ``kl_coef`` (when a reference is used), ``staleness`` (one int per sequence:
        ``version before the step - group.policy_version``), ``staleness_mean``/``staleness_max``,
        ``reward_mean`` (the task's reward, before any shaping), ``truncated_frac`` (samples
        cut off at the length limit), ``overlong_penalty`` (its mean, under truncation mode
        penalise), ``sequences`` (in the loss), ``tokens`` (response tokens trained on), ``seconds``.
        """
        start = time.perf_counter()
        algo = self.algo
        version_before = self.version
        beta = self.kl_controller.value
        batch, shaped, truncated = self._collate(groups)
        in_loss = ~truncated if algo.truncation.mode == "mask" else torch.ones_like(truncated)  # (B,)
        ref = self._reference_logprobs(batch)  # (B, L-1) or None
        critic_stats = self._write_advantages(batch, groups, shaped, ref, weights, beta)
        minis = self._mini_batches(groups)
        # pi_prox: the policy before the step's first update. With one update that update's own
        # forward pass gives it (logprobs.detach()); with several it is computed once, here.
        proximal = self.proximal_logprobs(batch) if len(minis) * self.ppo_epochs > 1 else None
        norm_tokens = algo.loss_norm_tokens or int(batch.response_mask.sum(dim=1).max().item())

        epochs = []
        for _ in range(self.ppo_epochs):
            sums: Counter = Counter()
            for lo, hi in minis:
                self._update(batch, lo, hi, in_loss, proximal, ref, beta, norm_tokens, version_before, sums)
            epochs.append(sums)
        self.version += 1
        stats = self._step_stats(batch, groups, epochs, shaped, truncated, in_loss, version_before, critic_stats)
        if self.reference is not None:
            stats["kl_coef"] = beta
            self.kl_controller.update(stats["ref_kl"], n_samples=len(batch))
        stats["seconds"] = time.perf_counter() - start
        return stats

    def _collate(self, groups: list[Group]) -> tuple[TrainBatch, list[np.ndarray], torch.Tensor]:
        """The step's padded batch (advantages still 0), its shaped rewards (one row per group) and
        which rows were truncated, (B,) bool; under truncation mode ``mask`` those rows' tokens
        are out of the loss (and still in their group's baseline)."""
        shaped = self.shaped_rewards(groups)
        batch = collate(groups, [np.zeros(len(g.samples), dtype=np.float32) for g in groups], self.pad_id)
        truncated = torch.from_numpy(np.concatenate([is_truncated(g) for g in groups]))  # (B,) in collate's order
        if self.algo.truncation.mode == "mask":
            batch.response_mask[truncated] = 0.0
        return batch, shaped, truncated

    def _micro_plans(self, batch: TrainBatch, lo: int, hi: int) -> list[MicroBatchPlan]:
        """Rows ``lo:hi`` cut into micro batches (``micro_batch_size`` sequences, or packed to
        ``micro_batch_tokens``: ``asyncrl.learner.packing``), their ``lo``/``hi`` rows of ``batch``."""
        cfg = self.cfg
        lengths = batch.attention_mask[lo:hi].sum(dim=1).tolist()
        plans = plan_micro_batches(lengths, cfg.micro_batch_size, cfg.micro_batch_tokens, self._row_tokens)
        for plan in plans:
            plan.lo, plan.hi = plan.lo + lo, plan.hi + lo
        return plans

    def _micro_bounds(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Rows ``lo:hi`` cut into micro batches of ``micro_batch_size`` sequences (no packing:
        the reference and the critic run on padded rows)."""
        size = self.cfg.micro_batch_size
        return [(a, min(a + size, hi)) for a in range(lo, hi, size)]

    def _mini_batches(self, groups: list[Group]) -> list[tuple[int, int]]:
        """Row ranges of the step's mini-batches: ``mini_batches`` runs of whole groups, in batch
        order, as equal in groups as they can be (fewer when the batch has fewer groups)."""
        offsets = np.cumsum([0] + [len(g.samples) for g in groups])
        parts = np.array_split(np.arange(len(groups)), min(self.mini_batches, len(groups)))
        return [(int(offsets[p[0]]), int(offsets[p[-1] + 1])) for p in parts]

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """log pi_ref of every response token, (B, L-1) on the CPU (0 off the response), by
        micro batches; None without a reference."""
        if self.reference is None:
            return None
        out = torch.zeros_like(batch.behaviour_logprobs)
        with torch.no_grad():
            for lo, hi in self._micro_bounds(0, len(batch)):
                micro = batch.slice(lo, hi).to(self.device)
                ref = self.reference.logprobs(  # (b, l-1)
                    micro.input_ids, micro.attention_mask, micro.response_mask, self.distribution
                )
                out[lo:hi, : ref.shape[1]] = ref.cpu()
        return out

    def proximal_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log pi_prox, (B, L-1) on the CPU: the current policy's logprobs of every response token
        by a no-grad forward pass in micro batches (the same forward the updates run), before any
        update of the step.

        Every update of the step takes its ratio and clip against these (the decoupled
        objective's proximal policy; plain PPO's old policy), as PPO does over epochs. With
        ``algorithm.proximal: log_linear`` they are the same: its interpolation between mu and
        pi_theta at the proximal version gives pi_theta itself, and the step's updates make no
        published version to interpolate towards.
        """
        out = torch.zeros_like(batch.behaviour_logprobs)
        self.engine.train()  # the mode of the updates' forward passes (dropout, if any)
        with torch.no_grad():
            for plan in self._micro_plans(batch, 0, len(batch)):
                micro = batch.slice(plan.lo, plan.hi).to(self.device)
                logprobs = self.score(micro, entropy=False, plan=plan).logprobs  # (b, l-1)
                out[plan.lo : plan.hi, : logprobs.shape[1]] = logprobs.cpu()
        return out

    def _write_advantages(self, batch: TrainBatch, groups, shaped, ref, weights, beta) -> dict:
        """Each sequence's advantage into ``batch.advantages`` (per token for gae): from the shaped
        rewards, less beta * KL(mu, ref) summed over the sequence when ``kl.use_in`` is reward,
        scaled by the groups' importance weights. Returns the critic's stats (gae), else {}."""
        algo = self.algo
        rewards = shaped
        if ref is not None and algo.kl.use_in == "reward" and algo.adv_estimator != "gae":  # gae: per token
            kl = KL_ESTIMATORS[algo.kl.estimator](batch.behaviour_logprobs, ref)  # (B, L-1)
            seq_kl = (kl * batch.response_mask).sum(dim=1).numpy()  # (B,)
            offsets = np.cumsum([0] + [len(g.samples) for g in groups])
            rewards = [r - beta * seq_kl[offsets[i] : offsets[i + 1]] for i, r in enumerate(rewards)]
        if algo.adv_estimator == "gae":
            bounds = self._micro_bounds(0, len(batch))
            micro_refs = [
                None if ref is None else ref[lo:hi, : batch.slice(lo, hi).response_mask.shape[1]] for lo, hi in bounds
            ]
            return self._critic_advantages(batch, bounds, np.concatenate(rewards), micro_refs, weights, beta)
        rows = self.weighted_advantages(groups, weights, rewards)
        batch.advantages[:] = torch.from_numpy(np.concatenate(rows).astype(np.float32))[:, None]
        return {}

    def _update(self, batch, lo, hi, in_loss, proximal, ref, beta, norm_tokens, version_before, sums) -> None:
        """One optimizer update on the mini-batch of rows ``lo:hi``: forward/backward by micro
        batches, gradients accumulated, then the step; its figures are added to ``sums``.

        Each micro batch's loss is normalised by the mini-batch's response tokens (and sequences),
        so the accumulated gradient is exactly that of the mini-batch's loss, however it is cut
        into micro batches; with one mini-batch, that of the whole batch.
        """
        algo = self.algo
        total_tokens = max(int(batch.response_mask[lo:hi].sum().item()), 1)
        num_seqs = int(in_loss[lo:hi].sum())
        plans = self._micro_plans(batch, lo, hi)
        self.engine.train()
        update_loss = 0.0
        for index, plan in enumerate(plans):
            a, b = plan.lo, plan.hi
            micro = batch.slice(a, b).to(self.device)
            mask = micro.response_mask  # (b, l-1)
            width = mask.shape[1]
            # Only the last micro batch is an accumulation boundary: ZeRO-1/2 hand the summed
            # gradients to the optimizer partitions there, not after every micro batch.
            self.engine.set_gradient_accumulation_boundary(index == len(plans) - 1)
            scores = self.score(micro, entropy=True, plan=plan)
            logprobs = scores.logprobs  # (b, l-1)
            if proximal is not None:
                prox = proximal[a:b, :width].to(self.device)
            elif algo.proximal == "log_linear":
                prox = log_linear_proximal_logprobs(
                    micro.behaviour_logprobs, logprobs, micro.policy_version, version_before, version_before
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
                norm_tokens=norm_tokens,
            )
            loss = policy_loss
            entropy = scores.entropy if algo.entropy_coef > 0 else scores.entropy.detach()  # (b, l-1)
            entropy_sum = (entropy * mask).sum()
            if algo.entropy_coef > 0:
                loss = loss - algo.entropy_coef * entropy_sum / total_tokens
            if ref is not None:
                kl = KL_ESTIMATORS[algo.kl.estimator](logprobs, ref[a:b, :width].to(self.device))  # (b, l-1)
                kl_sum = (kl * mask).sum()
                if algo.kl.use_in == "loss":
                    loss = loss + beta * kl_sum / total_tokens
                sums["ref_kl_sum"] += float(kl_sum.detach())
            self.engine.backward(loss, scale_wrt_gas=False)

            with torch.no_grad():
                update_loss += float(loss.detach())
                sums["policy_loss"] += float(policy_loss.detach())
                sums["tokens"] += float(mask.sum())
                sums["slots_used"] += plan.tokens
                sums["slots"] += plan.capacity
                sums["entropy_sum"] += float(entropy_sum.detach())
                sums["outside"] += float((scores.outside * mask).sum())
                keep, w, raw = parts["keep"], parts["weight"], parts["weight_raw"]
                sums["kept"] += float(keep.sum())
                sums["clipped"] += float((parts["clipped"] * keep).sum())
                log_ratio = parts["log_ratio"]  # log pi_theta - log anchor
                sums["approx_kl_sum"] += float((((log_ratio.exp() - 1) - log_ratio) * keep).sum())
                sums["w_sum"] += float((w * mask).sum())
                sums["w_sq_sum"] += float((w.square() * mask).sum())
                sums["raw_sum"] += float((raw * mask).sum())
                k3 = (raw - 1) - raw.log()  # (b, l-1) per-token k3 of KL(mu || pi_prox)
                sums["behaviour_kl_sum"] += float((k3 * mask).sum())
                fresh = mask * (version_before - micro.policy_version == 0).to(mask.dtype)[:, None]
                sums["fresh_tokens"] += float(fresh.sum())
                sums["mismatch_kl_sum"] += float((k3 * fresh).sum())
                if bool((mask > 0).any()):
                    sums["is_weight_max"] = max(sums["is_weight_max"], float(raw[mask > 0].max()))
        lr, grad_norm = self._optimizer_update()
        sums["lr"] = lr
        sums.setdefault("grad_norms", []).append(grad_norm)
        sums.setdefault("update_losses", []).append(update_loss)

    def _step_stats(self, batch, groups, epochs, shaped, truncated, in_loss, version_before, critic_stats) -> dict:
        """The step's stats (see ``train_step``) from each epoch's sums. pi_prox and mu do not
        change within a step, so the importance-weight figures are those of one pass (the
        first epoch); the others are over every update."""
        first = epochs[0]
        tokens = sum(e["tokens"] for e in epochs)
        kept = sum(e["kept"] for e in epochs)
        total_tokens = max(batch.num_tokens, 1)
        losses = [loss for e in epochs for loss in e["update_losses"]]
        policy_losses = sum(e["policy_loss"] for e in epochs)
        staleness = (version_before - batch.policy_version).tolist()
        stats = {
            "version": self.version,
            "updates": self.updates,
            "loss": float(np.mean(losses)),
            "policy_loss": policy_losses / len(losses),
            "lr": epochs[-1]["lr"],
            **_clip_stats([n for e in epochs for n in e["grad_norms"]], self.cfg.grad_clip),
            "clipfrac": sum(e["clipped"] for e in epochs) / max(kept, 1.0),
            "approx_kl": sum(e["approx_kl_sum"] for e in epochs) / max(kept, 1.0),
            "is_weight_mean": first["raw_sum"] / total_tokens,
            "is_weight_max": first["is_weight_max"],
            "is_weight_ess": first["w_sum"] ** 2 / max(total_tokens * first["w_sq_sum"], 1e-12),
            "masked_frac": 1.0 - first["kept"] / total_tokens if batch.num_tokens else 0.0,
            "behaviour_kl": first["behaviour_kl_sum"] / total_tokens,
            "mismatch_kl": first["mismatch_kl_sum"] / first["fresh_tokens"] if first["fresh_tokens"] else float("nan"),
            "entropy": sum(e["entropy_sum"] for e in epochs) / max(tokens, 1.0),
            "outside_truncation_frac": sum(e["outside"] for e in epochs) / max(tokens, 1.0),
            "padding_frac": 1.0 - sum(e["slots_used"] for e in epochs) / max(sum(e["slots"] for e in epochs), 1.0),
            "staleness": staleness,
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": int(max(staleness)),
            "reward_mean": float(np.mean([s.reward for g in groups for s in g.samples])),
            "truncated_frac": float(truncated.float().mean()),
            "sequences": int(in_loss.sum()),
            "tokens": batch.num_tokens,
            **critic_stats,
        }
        if len(losses) > 1:
            stats["loss_by_update"] = losses
            stats["grad_norm_by_update"] = [n for e in epochs for n in e["grad_norms"]]
        if len(epochs) > 1:
            stats["clipfrac_by_epoch"] = [e["clipped"] / max(e["kept"], 1.0) for e in epochs]
            stats["approx_kl_by_epoch"] = [e["approx_kl_sum"] / max(e["kept"], 1.0) for e in epochs]
        if self.algo.truncation.mode == "penalise":
            task = np.concatenate([[s.reward for s in g.samples] for g in groups])
            stats["overlong_penalty"] = float(np.mean(np.concatenate(shaped) - task))
        if self.reference is not None:
            stats["ref_kl"] = sum(e["ref_kl_sum"] for e in epochs) / max(tokens, 1.0)
        return stats

    def _set_lr(self) -> float:
        """Set the optimizer's learning rate to the schedule's at update ``self.updates``."""
        cfg = self.cfg
        lr = cfg.lr * lr_factor(
            self.updates, cfg.lr_schedule, cfg.lr_warmup_steps, cfg.lr_decay_steps or 1, cfg.min_lr_ratio
        )
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _optimizer_update(self) -> tuple[float, float]:
        """One optimizer update on the accumulated gradients (clipped by DeepSpeed); returns its
        learning rate and the gradient norm before clipping, and sets the next update's rate."""
        lr = self._set_lr()
        own_grad_norm = None
        if self.cfg.zero_stage == 0 and self.cfg.dtype == "fp32":
            # DeepSpeed clips fp32 ZeRO-0 gradients without recording the norm; measure it here.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            if grads:
                own_grad_norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g) for g in grads])
                ).item()
        self.engine.step()
        self.updates += 1
        self._set_lr()
        grad_norm = own_grad_norm if own_grad_norm is not None else self.engine.get_global_grad_norm()
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()
        return lr, float(grad_norm) if grad_norm is not None else float("nan")

    # -----------------------------------------------------------------------------------------
    # weights out

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full weights, HF names (``model.layers.0.self_attn.q_proj.weight``...), fp32 on CPU.

        Collective under ZeRO-3 (each module's partitions are all-gathered in turn, copied, and
        released, so at most one module is whole at a time): call it on every rank. With
        ``rank0_only`` other ranks get ``{}`` (saves a host copy of the model per rank).
        Under bf16 these are the bf16 module weights the generators will run, widened to fp32.
        """
        want = not rank0_only or torch.distributed.get_rank() == 0
        module = self.engine.module
        if self.cfg.zero_stage < 3:
            if not want:
                return {}
            return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in module.state_dict().items()}

        import deepspeed

        state: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # ds_id -> copy, so tied weights stay one tensor

        def visit(mod: torch.nn.Module, prefix: str) -> None:
            params = list(mod.parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if want:
                    for name, param in mod.named_parameters(recurse=False):
                        key = getattr(param, "ds_id", id(param))
                        if key not in copies:
                            # copy=True: on CPU .to("cpu") would alias the gathered buffer,
                            # which is freed (and reused) when the context exits.
                            copies[key] = param.detach().to("cpu", torch.float32, copy=True)
                        state[prefix + name] = copies[key]
                    for name, buf in mod.named_buffers(recurse=False):
                        if buf is not None and name not in mod._non_persistent_buffers_set:
                            state[prefix + name] = buf.detach().to("cpu", torch.float32, copy=True)
            for name, child in mod.named_children():
                visit(child, prefix + name + ".")

        visit(module, "")
        return state

    def weight_buckets(self, bucket_bytes: int):
        """The weights as size-capped buckets of ``(HF name, tensor)``, for ``asyncrl.weights``
        publishers: under ZeRO-3 each bucket is gathered only while the caller holds it, so the
        extra memory is one bucket, not the model. Collective under ZeRO-3 (iterate on every
        rank); tied weights appear once; tensors keep the module dtype (bf16 under bf16)."""
        from asyncrl.weights.buckets import iter_buckets

        return iter_buckets(self.engine.module, bucket_bytes)

    def probe(self) -> dict:
        """The learner's logprobs of the fixed probe text (``asyncrl.weights.probe``), sent with
        each version so the generators can check what they serve. Collective under ZeRO-3."""
        from transformers import AutoTokenizer

        from asyncrl.weights.probe import learner_probe

        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return learner_probe(self.engine.module, self._tokenizer)

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write a Hugging Face model dir (config, fp32 ``model.safetensors``, tokenizer files).

        Collective under ZeRO-3; rank 0 writes. The tokenizer and generation config are copied
        from ``model_dir``. Returns ``out_dir``.
        """
        from safetensors.torch import save_file

        out = Path(out_dir)
        state = self.full_state_dict(rank0_only=True)
        if torch.distributed.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            for path in self.model_dir.iterdir():
                if (
                    path.is_file()
                    and path.name != "config.json"
                    and path.name not in _WEIGHT_INDEX_FILES
                    and not path.name.endswith(_WEIGHT_FILE_SUFFIXES)
                ):
                    shutil.copy2(path, out / path.name)
            if getattr(self.hf_config, "tie_word_embeddings", False):
                # A tied output head is the embedding: HF stores it once and re-ties on load.
                state.pop("lm_head.weight", None)
            # safetensors refuses tensors that share memory; give each key its own.
            seen: set[int] = set()
            for key, tensor in list(state.items()):
                if id(tensor) in seen:
                    state[key] = tensor.clone()
                seen.add(id(tensor))
            save_file(
                {k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
            )
            config = self.hf_config.__class__.from_dict(self.hf_config.to_dict())
            config.dtype = "float32"
            config.save_pretrained(out)
        torch.distributed.barrier()
        return out

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def save_state(self, out_dir: str | Path) -> None:
        """Everything a resume needs to continue bit for bit: DeepSpeed's checkpoint of the policy
        (weights, optimizer moments, ZeRO partitions) and the critic's, the version, the optimizer
        updates taken (the learning-rate schedule's position), the KL controller's beta and the
        RNG states. Collective: every rank calls it."""
        out = Path(out_dir)
        state = {"version": self.version, "updates": self.updates, "kl_coef": self.kl_controller.value}
        self.engine.save_checkpoint(str(out), tag="policy", client_state=state)
        if self.critic is not None:
            self.critic.engine.save_checkpoint(str(out), tag="critic")
        if torch.distributed.get_rank() == 0:
            torch.save(_rng_state(), out / "rng.pt")

    def load_state(self, in_dir: str | Path) -> None:
        """Restore what ``save_state`` wrote (the same config, the same number of ranks)."""
        src = Path(in_dir)
        if not (src / "policy").is_dir():
            raise FileNotFoundError(f"{src} holds no policy checkpoint (no {src / 'policy'} directory)")
        _, state = self.engine.load_checkpoint(str(src), tag="policy")
        if state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint 'policy' in {src}")
        self.version = int(state["version"])
        self.updates = int(state.get("updates", self.version))  # older checkpoints: one update per step
        self._set_lr()
        self.kl_controller.value = float(state["kl_coef"])
        if self.critic is not None:
            self.critic.engine.load_checkpoint(str(src), tag="critic")
        if (src / "rng.pt").exists():
            _set_rng_state(torch.load(src / "rng.pt", weights_only=False))

    def _critic_advantages(self, batch: TrainBatch, bounds, rewards: np.ndarray, ref_logprobs, weights, beta) -> dict:
        """Per-token advantages from the critic (one critic step), written into ``batch.advantages``.

        Token rewards: the outcome reward on the last response token, minus beta * KL(mu, ref) on
        every token when ``kl.use_in`` is reward. V-trace targets use log(pi_prox / mu) from a
        no-grad forward pass of the policy. Then optional whitening over the batch's response
        tokens, and each group's importance weight.
        """
        algo = self.algo
        micros = [batch.slice(lo, hi) for lo, hi in bounds]
        token_rewards_list, log_rhos = [], []
        from asyncrl.learner.critic import token_rewards

        for (lo, hi), micro, ref in zip(bounds, micros, ref_logprobs):
            r = token_rewards(micro, torch.from_numpy(rewards[lo:hi]))  # (b, l-1)
            if ref is not None and algo.kl.use_in == "reward":
                r = (
                    r
                    - beta * KL_ESTIMATORS[algo.kl.estimator](micro.behaviour_logprobs, ref.cpu()) * micro.response_mask
                )
            token_rewards_list.append(r)
            if algo.critic.targets == "vtrace":
                with torch.no_grad():
                    lp = self.score(micro.to(self.device), entropy=False).logprobs.cpu()
                log_rhos.append((lp - micro.behaviour_logprobs) * micro.response_mask)
            else:
                log_rhos.append(None)
        total_tokens = max(batch.num_tokens, 1)
        advantages, stats = self.critic.advantages_and_step(micros, token_rewards_list, log_rhos, total_tokens)
        batch.advantages.zero_()
        for (lo, hi), adv in zip(bounds, advantages):
            batch.advantages[lo:hi, : adv.shape[1]] = adv.cpu()
        mask = batch.response_mask
        if algo.critic.whiten_advantages:
            mean = (batch.advantages * mask).sum() / mask.sum().clamp(min=1)
            var = (((batch.advantages - mean) * mask).square()).sum() / mask.sum().clamp(min=1)
            batch.advantages.copy_((batch.advantages - mean) / (var.sqrt() + 1e-6) * mask)
        if weights is not None:
            w = torch.as_tensor(np.asarray(weights, dtype=np.float32).reshape(-1))
            if w.numel() != int(batch.group_index.max()) + 1 or not bool(torch.isfinite(w).all() and (w >= 0).all()):
                raise ValueError(f"weights ({w.tolist()}) must be finite, >= 0 and one per group")
            batch.advantages.mul_(w[batch.group_index][:, None])
        return stats

    def score(self, micro: TrainBatch, entropy: bool, plan: MicroBatchPlan | None = None) -> TokenScores:
        """pi_theta's log-probabilities (and entropy) of one micro batch's response tokens, (b, l-1)
        each, under the sampling distribution, in memory bounded per token (``token_scores``).

        With a packed ``plan`` the forward pass runs on the sequences packed into rows, and the
        results come back in the micro batch's padded layout (``asyncrl.learner.packing``)."""
        if plan is None or plan.placement is None:
            return token_scores(
                self.engine,
                micro.input_ids,
                micro.attention_mask,
                micro.response_mask,
                self.distribution,
                chunk_tokens=self.cfg.logits_chunk_tokens,
                entropy=entropy,
                entropy_grad=self.algo.entropy_coef > 0,  # else kept out of the backward
            )
        packed = pack(micro.input_ids, micro.attention_mask, micro.response_mask, plan, self.pad_id)
        scores = token_scores(
            self.engine,
            packed.input_ids,
            None,  # attention stays within each sequence: Hugging Face reads the boundaries from position_ids
            packed.score_mask,
            self.distribution,
            position_ids=packed.position_ids,
            chunk_tokens=self.cfg.logits_chunk_tokens,
            entropy=entropy,
            entropy_grad=self.algo.entropy_coef > 0,  # else kept out of the backward
        )
        return TokenScores(*(packed.unpack(x, micro.response_mask) for x in scores))

    def train_batch(self, groups: list[Group], weights=None) -> TrainBatch:
        """The collated batch ``train_step`` would train on, without a KL reward penalty (for
        inspection and tests)."""
        return collate(groups, self.weighted_advantages(groups, weights), self.pad_id)


def _clip_stats(grad_norms: list[float], grad_clip: float) -> dict:
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


def _rng_state() -> dict:
    import random

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    import random

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
