"""Config of the learner process: the loop (``LearnerConfig``), the trainer (``TrainerConfig``) and
the algorithm it optimises (``AlgorithmConfig``, the run's ``algorithm`` section), and the simulated
learner's timing model (``MockTrainerConfig``, ``simulation.learner``). Declarations only: the
root config (``asyncrl.config``) imports this module and nothing else of the learner.

Kept apart from ``trainer.py`` so that reading a config never imports torch or DeepSpeed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config
from asyncrl.learner.distill_config import DistillConfig
from asyncrl.learner.online_dpo_config import OnlineDPOConfig, check_objective
from asyncrl.learner.trainer_config import TrainerConfig

__all__ = ["TrainerConfig"]  # declared beside this module (its length limit), read from here as before


AdvEstimator = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "pass_at_k", "gae"
]
PolicyLoss = Literal["ppo_clip", "gspo", "cispo", "sapo", "gmpo"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Correction = Literal["none", "behaviour_ppo", "tis", "mis", "decoupled"]
Rejection = Literal["none", "token_k2", "token_k3", "seq_mean_k3", "seq_max_k2"]


class KLConfig(Config):
    """The KL penalty to a frozen reference policy (the weights the run started from)."""

    coef: float = 0.0
    """Initial KL coefficient beta; 0 (and a fixed controller) turns the KL term and the reference model off."""
    estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    """Per-token KL(pi_theta || pi_ref) estimator: k1 = log r, k2 = (log r)^2 / 2, k3 = 1/r - 1 + log r (low variance), abs = |log r|, r = pi_theta / pi_ref."""
    use_in: Literal["loss", "reward"] = "loss"
    """Add beta * KL(pi_theta, ref) to the loss (GRPO style), or subtract beta * KL(mu, ref) from the reward before the advantages (PPO/REINFORCE++ style): per token with gae, summed over the sequence otherwise."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """Keep beta fixed, or adapt it towards ``target`` (Ziegler et al. 2019)."""
    target: float = 0.1
    """Adaptive controller: the token-mean KL to the reference that beta is steered towards."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller: samples over which a 20% KL error changes beta by 20%."""
    reference: Literal["colocated", "process"] = "colocated"
    """Where the reference model runs: a frozen copy inside each learner rank (no optimizer; under ZeRO-3 partitioned over the ranks like the policy; with LoRA the base with the adapter off), or
    its own process that the learner asks over ZeroMQ (no second model in the learner's memory)."""

    @field_validator("coef", "target")
    @classmethod
    def _check_non_negative(cls, v: float, info) -> float:
        if not v >= 0:
            raise ValueError(f"kl.{info.field_name} ({v}) must be >= 0")
        return v

    @property
    def enabled(self) -> bool:
        """Whether the reference model is needed: a non-zero beta, or one that may become non-zero."""
        return self.coef > 0


class CriticConfig(Config):
    """The value model of ``adv_estimator: gae``: the policy's backbone plus a scalar head, trained
    by its own DeepSpeed engine (same ZeRO stage and precision as the policy)."""

    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate of the critic."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay of the critic (0 by default, as the policy's ``trainer.weight_decay``)."""
    value_clip: float | None = 0.2
    """Clip the new value to old +- value_clip in the value loss (PPO's value clipping); None: off."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    targets: Literal["gae", "vtrace"] = "gae"
    """The critic's targets and advantages: GAE on the stale samples as they are, or V-trace (rho_bar = c_bar = 1, pi_prox / mu from one extra no-grad policy forward), correcting them for staleness."""
    whiten_advantages: bool = True
    """Normalise the advantages to mean 0, std 1 over the batch's response tokens."""


class TruncationConfig(Config):
    """What training does with answers cut off at the length limit (``finish_reason == "length"``);
    formulas and reasons in ``asyncrl.learner.truncation``.

    The default, ``keep``, is what verl, OpenRLHF and trl do unless told otherwise (DAPO's overlong
    filtering and soft punishment are opt-in in verl too): a recipe that moves to asyncrl trains
    on the same samples with the same rewards. Every step reports ``truncated_frac``.
    """

    mode: Literal["keep", "mask", "penalise", "drop"] = "keep"
    """keep (train on them as they are), mask (in the group's baseline, out of the loss: DAPO's overlong filtering), penalise (DAPO's soft overlong punishment added to every answer's reward by its length), drop (the buffer drops a group holding one, reason ``truncated``)."""
    max_tokens: int | None = Field(None, ge=1)
    """penalise: L_max, the length at which the penalty reaches -penalty; None: ``sampling.max_tokens``."""
    cache_tokens: int | None = Field(None, ge=1)
    """penalise: L_cache, the interval below L_max over which the penalty grows linearly from 0; None: a fifth of L_max (DAPO: 4,096 of 20,480)."""
    penalty: float = Field(1.0, gt=0)
    """penalise: the penalty's size at L_max (verl's ``overlong_buffer.penalty_factor``)."""

    def interval(self, max_tokens: int) -> tuple[int, int]:
        """(L_max, L_cache), the defaults filled from ``sampling.max_tokens``."""
        l_max = self.max_tokens or max_tokens
        l_cache = self.cache_tokens or max(1, l_max // 5)
        if l_cache > l_max:
            raise ValueError(f"algorithm.truncation.cache_tokens ({l_cache}) must be <= its max_tokens ({l_max})")
        return l_max, l_cache


class AlgorithmConfig(Config):
    """What the learner optimises: advantages, policy loss, off-policy correction, KL and entropy.

    Each name is a key of a plain dict in ``asyncrl.learner`` (``ADV_ESTIMATORS``,
    ``POLICY_LOSSES``, ``LOSS_AGG_MODES``, ``CORRECTIONS``, ``REJECTIONS``, ``KL_ESTIMATORS``) whose function
    documents its formula. The validators reject combinations that cannot run, naming the keys
    (``check_run`` those that need other sections). The hard staleness bound is the buffer's
    ``buffer.max_staleness``: older groups are dropped there, counted under the reason ``stale``.
    """

    objective: Literal["policy_gradient", "online_dpo"] = "policy_gradient"
    """What the learner minimises: policy_gradient (the advantages, policy loss, correction, KL and entropy below) or online_dpo (a preference loss on each group's best and worst answers, ``algorithm.dpo``; ``asyncrl.learner.online_dpo``)."""
    dpo: OnlineDPOConfig = OnlineDPOConfig()
    """online_dpo: beta, the loss variant and how pairs are drawn; an error off its defaults with objective policy_gradient."""
    adv_estimator: AdvEstimator = "grpo"
    """grpo (group mean/std), dr_grpo (group mean only), rloo (leave-one-out mean), reinforce_pp (batch-whitened reward), reinforce_pp_baseline (group mean, then batch-whitened), remax (minus the greedy answer's reward; needs generator.greedy_baseline), opo (minus the group's length-weighted mean reward), pass_at_k (the analytical advantage of pass@k training, k = pass_k), gae (per-token, needs algorithm.critic)."""
    std_estimator: Literal["population", "unbiased"] = "population"
    """Every standard deviation the advantages take (GRPO's group std, REINFORCE++'s batch std, the critic's whitening): population (divide the variance by N, as OpenRLHF whitens REINFORCE++ and the critic) or unbiased (by N - 1, as verl whitens, and as verl, OpenRLHF and trl all take GRPO's group std: choose it to match their GRPO; GRPO's advantages shrink by sqrt((n - 1) / n), x0.71 at n = 2)."""
    reinforce_pp_whitening: Literal["token", "sequence"] = "token"
    """reinforce_pp(_baseline): whiten over every response token of the batch (the paper's, OpenRLHF's and verl's: long answers weigh more), or over sequences (each answer once)."""
    pass_k: int = Field(1, ge=1)
    """pass_at_k: the k of pass@k (<= sampling.n); 1 is GRPO."""
    policy_loss: PolicyLoss = "ppo_clip"
    """ppo_clip (token ratio, clip_low/clip_high, dual_clip), gspo (sequence ratio, length-normalised), cispo (clipped stop-gradient weight on log pi), sapo (soft sigmoid gate, sapo_tau_pos/sapo_tau_neg), gmpo (geometric mean of the token ratios, clip_low/clip_high on the log-ratio; the paper uses 0.4)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses become one number: token-mean, token-sum (no normalisation), seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm (token sums over a constant, Dr. GRPO)."""
    kl_entropy_agg_mode: LossAggMode | None = None
    """How the entropy bonus and the KL term of the loss (kl.use_in: loss) are aggregated; None: as loss_agg_mode (verl's choice); token-mean: every token weighs the same whatever the policy loss does (this learner's behaviour before the key existed)."""
    loss_norm_tokens: int | None = Field(None, ge=1)
    """The constant of seq-mean-token-sum-norm; None: ``sampling.max_tokens``."""
    clip_low: float = Field(0.2, gt=0)
    """PPO clip: ratio floor 1 - clip_low."""
    clip_high: float = Field(0.2, gt=0)
    """PPO clip: ratio ceiling 1 + clip_high (DAPO's clip-higher: clip_high > clip_low); CISPO's weight ceiling."""
    sapo_tau_pos: float = Field(1.0, gt=0)
    """sapo: the gate's temperature for tokens with A > 0 (larger: the gradient fades faster as the ratio leaves 1)."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """sapo: the gate's temperature for tokens with A <= 0 (the paper: a little above sapo_tau_pos)."""
    dual_clip: float | None = None
    """Dual clip c > 1 (Ye et al. 2020): for A < 0 the token loss is at most -c * A; None: off."""
    correction: Correction = "decoupled"
    """Off-policy correction for the behaviour policy mu (the generator's logprobs, possibly stale): none (the learner's recomputed logprobs stand for mu: naive), behaviour_ppo (the PPO ratio is taken against mu), tis (truncated IS), mis (masked IS), decoupled (AReaL: clip around pi_prox, weight pi_prox / mu)."""
    correction_level: Literal["token", "sequence"] = "token"
    """tis / mis: one weight per token, or per sequence (the product of its token ratios)."""
    is_cap: float | None = 5.0
    """tis: truncate the weight at this C (>= 1, required); decoupled: optional cap, None for none."""
    mis_low: float = Field(0.5, ge=0)
    """mis: tokens (sequences) with weight below this are dropped."""
    mis_high: float = 2.0
    """mis: tokens (sequences) with weight above this are dropped."""
    rejection: Rejection = "none"
    """Drop tokens or whole sequences whose train/behaviour divergence (r = pi_prox / mu) exceeds rejection_threshold, on top of the correction: token_k2 ((log r)^2 / 2 per token), token_k3 (r - 1 - log r per token), seq_mean_k3 (a sequence's mean k3), seq_max_k2 (a sequence's largest k2); none: off (``asyncrl.learner.rejection``)."""
    rejection_threshold: float | None = Field(None, gt=0)
    """The divergence above which rejection drops a token (sequence); required by a rejection, e.g. 0.01 for seq_mean_k3."""
    is_batch_normalise: bool = False
    """tis / mis / decoupled: scale the importance weights to mean 1 over the kept tokens (sequences, at correction_level sequence) of each mini-batch, so truncation and masking do not shrink the step (self-normalised IS; verl's rollout_is_batch_normalize). Costs one no-grad forward pass per step for pi_prox when the step takes a single update."""
    proximal: Literal["recompute", "log_linear"] = "recompute"
    """decoupled: pi_prox from the learner's forward pass, or AReaL's log-linear interpolation between mu and pi_theta by version."""
    kl: KLConfig = KLConfig()
    """KL to the reference policy."""
    critic: CriticConfig | None = None
    """The value model; required by (and only used by) ``adv_estimator: gae``."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: loss -= entropy_coef * the entropy of pi_theta aggregated by kl_entropy_agg_mode."""
    truncation: TruncationConfig = TruncationConfig()
    """Answers cut off at ``sampling.max_tokens``: keep (default), mask, penalise or drop."""
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher (needs a reward of kind ``teacher``): e.g. ``{coef: 1.0}``; None: off."""

    @field_validator("dual_clip")
    @classmethod
    def _check_dual_clip(cls, v: float | None) -> float | None:
        if v is not None and not v > 1:
            raise ValueError(f"algorithm.dual_clip ({v}) must be > 1 or None")
        return v

    @field_validator("is_cap")
    @classmethod
    def _check_cap(cls, v: float | None) -> float | None:
        if v is not None and v < 1:
            raise ValueError(f"algorithm.is_cap ({v}) must be >= 1 or None")
        return v

    @model_validator(mode="after")
    def _check_self(self) -> AlgorithmConfig:
        check_objective(self)  # first: with online_dpo the policy-gradient checks below do not apply
        if self.mis_high <= self.mis_low:
            raise ValueError(f"algorithm.mis_high ({self.mis_high}) must be > algorithm.mis_low ({self.mis_low})")
        if self.correction == "tis" and self.is_cap is None:
            raise ValueError("algorithm.correction 'tis' needs algorithm.is_cap (the truncation C), got None")
        if self.adv_estimator == "gae" and self.critic is None:
            raise ValueError("algorithm.adv_estimator 'gae' needs a critic: set algorithm.critic (e.g. {lr: 1.0e-4})")
        if self.adv_estimator != "gae" and self.critic is not None:
            raise ValueError(
                f"algorithm.critic is set but algorithm.adv_estimator '{self.adv_estimator}' does not use it (only 'gae' does)"
            )
        if self.policy_loss == "gspo" and self.correction_level == "token" and self.correction in ("tis", "mis"):
            raise ValueError(
                f"algorithm.policy_loss 'gspo' is sequence-level: algorithm.correction '{self.correction}' needs "
                "algorithm.correction_level 'sequence', got 'token'"
            )
        if self.rejection != "none" and self.rejection_threshold is None:
            raise ValueError(f"algorithm.rejection '{self.rejection}' needs algorithm.rejection_threshold, got None")
        if self.rejection == "none" and self.rejection_threshold is not None:
            raise ValueError(
                f"algorithm.rejection_threshold ({self.rejection_threshold}) is set but algorithm.rejection is 'none'"
            )
        if self.policy_loss == "gspo" and self.rejection in ("token_k2", "token_k3"):
            raise ValueError(
                f"algorithm.policy_loss 'gspo' is sequence-level: algorithm.rejection '{self.rejection}' drops single "
                "tokens; use seq_mean_k3 or seq_max_k2"
            )
        if self.is_batch_normalise and self.correction not in ("tis", "mis", "decoupled"):
            raise ValueError(
                f"algorithm.is_batch_normalise needs importance weights: algorithm.correction '{self.correction}' "
                "has none (use tis, mis or decoupled)"
            )
        if self.policy_loss == "gmpo" and self.adv_estimator == "gae":
            raise ValueError(
                "algorithm.policy_loss 'gmpo' needs one advantage per sequence: algorithm.adv_estimator "
                "'gae' gives one per token (use an outcome estimator)"
            )
        if self.policy_loss != "ppo_clip" and self.dual_clip is not None:
            raise ValueError(
                f"algorithm.dual_clip ({self.dual_clip}) applies to policy_loss 'ppo_clip' only, "
                f"not algorithm.policy_loss '{self.policy_loss}'"
            )
        if self.pass_k != 1 and self.adv_estimator != "pass_at_k":
            raise ValueError(
                f"algorithm.pass_k ({self.pass_k}) is set but algorithm.adv_estimator '{self.adv_estimator}' "
                "does not use it (only 'pass_at_k' does)"
            )
        if self.distill is not None and not self.distill.rewards and self.adv_estimator == "gae":
            raise ValueError(
                "algorithm.distill.rewards false (distillation alone) leaves algorithm.adv_estimator 'gae' "
                "no reward for its critic: use an outcome estimator (grpo)"
            )
        if self.distill is not None and self.policy_loss == "gmpo":
            raise ValueError(
                "algorithm.policy_loss 'gmpo' needs one advantage per sequence: algorithm.distill gives one "
                "per token (use ppo_clip)"
            )
        if self.kl.controller == "adaptive" and self.kl.coef == 0:
            raise ValueError(
                "algorithm.kl.controller 'adaptive' needs algorithm.kl.coef > 0 (it multiplies beta), got 0"
            )
        return self

    @property
    def uses_reference(self) -> bool:
        """Whether the frozen reference policy runs: for the KL term, or as online DPO's reference."""
        return self.kl.enabled or self.objective == "online_dpo"

    def check_run(
        self,
        group_size: int,
        greedy_baseline: bool = False,
        max_tokens: int | None = None,
        auto_staleness: bool = False,
    ) -> None:
        """Checks that need other sections: ``sampling.n`` (the group size), whether the
        generators decode a greedy answer per prompt (``generator.greedy_baseline``), the
        sampling length limit (``sampling.max_tokens``) and whether the staleness bound adapts
        (``buffer.max_staleness: auto``)."""
        if self.objective == "online_dpo" and auto_staleness:
            raise ValueError(
                "buffer.max_staleness 'auto' steers by the policy-gradient step's importance weights, which "
                "algorithm.objective 'online_dpo' does not compute: give buffer.max_staleness a number"
            )
        if max_tokens is not None and self.truncation.mode == "penalise":
            l_max, _ = self.truncation.interval(max_tokens)
            if l_max > max_tokens:
                raise ValueError(
                    f"algorithm.truncation.max_tokens ({l_max}) must be <= sampling.max_tokens ({max_tokens}): "
                    "no answer can be longer than the sampling limit"
                )
        if self.objective == "online_dpo" and group_size < 2:
            raise ValueError(
                f"algorithm.objective 'online_dpo' pairs a group's answers: it needs sampling.n >= 2, got {group_size}"
            )
        if self.adv_estimator == "remax" and not greedy_baseline:
            raise ValueError(
                "algorithm.adv_estimator 'remax' needs the reward of each prompt's greedy answer: "
                "set generator.greedy_baseline: true"
            )
        group_estimators = (
            "grpo",
            "dr_grpo",
            "rloo",
            "reinforce_pp_baseline",
            "opo",
            "pass_at_k",
        )  # gae, reinforce_pp: none
        if self.adv_estimator in group_estimators and group_size < 2:
            raise ValueError(
                f"algorithm.adv_estimator '{self.adv_estimator}' needs sampling.n >= 2 (a group baseline), got {group_size}"
            )
        if self.adv_estimator == "pass_at_k" and self.pass_k > group_size:
            raise ValueError(
                f"algorithm.pass_k ({self.pass_k}) must be <= sampling.n ({group_size}): k answers of a group"
            )


class LearnerConfig(Config):
    """The learner loop. A learner step trains one batch and makes one policy version;
    ``policy_version``, staleness and every count below are in learner steps, whatever the
    optimizer updates per step (see ``asyncrl.learner.trainer``)."""

    total_steps: int = Field(100, ge=1)
    """Learner steps to train (the final policy version)."""
    ranks: int = Field(1, ge=1)
    """Learner processes forming one DeepSpeed data-parallel group (gloo on CPUs, NCCL on GPUs).
    Every step each rank trains on its share of the same batch, whole groups each; the loss and
    gradient equal one rank's on the whole batch (``asyncrl.learner.sharding``)."""
    sequence_parallel: int = Field(1, ge=1)
    """Ranks that share each sequence (DeepSpeed-Ulysses sequence parallelism, for answers too long
    for one device's activations): each holds a contiguous 1/N of every row's positions and attends
    over the whole row for 1/N of the heads (``asyncrl.learner.ulysses``). Divides ``ranks``; the
    data-parallel size is ranks / sequence_parallel. 1: off."""
    batch_groups: int = Field(16, ge=1)
    """Groups (prompts) per learner step; samples per step = batch_groups × sampling.n."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch; every pass takes its ratio and clip against the policy before the step's first update."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per pass, each on a run of whole groups (a group is never split); at most batch_groups."""
    broadcast_every: int = Field(2, ge=1)
    """Publish weights to the generators every this many learner steps."""
    batch_timeout_s: float = Field(5.0, gt=0)
    """Seconds one request for a batch waits before it is asked again (and the wait logged)."""
    trainer: TrainerConfig = TrainerConfig()
    """The DeepSpeed engine and the loss."""

    @model_validator(mode="after")
    def _check_ranks(self) -> LearnerConfig:
        if self.ranks % self.sequence_parallel:
            raise ValueError(
                f"learner.sequence_parallel ({self.sequence_parallel}) must divide learner.ranks ({self.ranks}): "
                "each sequence-parallel group is that many ranks"
            )
        if self.data_parallel > self.batch_groups:
            raise ValueError(
                f"learner.ranks / learner.sequence_parallel ({self.data_parallel}) must be <= learner.batch_groups "
                f"({self.batch_groups}): each data-parallel rank trains whole groups of the batch"
            )
        return self

    @model_validator(mode="after")
    def _check_mini_batches(self) -> LearnerConfig:
        if self.mini_batches > self.batch_groups:
            raise ValueError(
                f"learner.mini_batches ({self.mini_batches}) must be <= learner.batch_groups ({self.batch_groups}): "
                "a mini-batch holds whole groups"
            )
        return self

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: groups of ``sequence_parallel`` ranks that train different rows."""
        return self.ranks // self.sequence_parallel

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per learner step."""
        return self.ppo_epochs * self.mini_batches


class MockTrainerConfig(Config):
    """Timing model of a simulated learner."""

    step_overhead_s: float = Field(0.02, ge=0)
    """Fixed cost of one optimizer step (optimizer update, all-reduce latency)."""
    s_per_token: float = Field(2e-5, ge=0)
    """Forward + backward cost per token of the batch."""
    weight_bytes: int = Field(1 << 20, ge=4)
    """Size of the weights published to the generators."""
    behaviour_kl_per_version: float = Field(0.0, ge=0)
    """Simulated off-policy signals: behaviour KL per token of a sample, per version of staleness (0: on-policy figures)."""
    weights_from: str | None = None
    """A Hugging Face model directory whose safetensors are published instead of a blank buffer
    (for real generator engines, which must be able to load what they receive)."""
