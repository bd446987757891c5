"""The policy trainer's section of the config (``learner.trainer``, ``TrainerConfig``): its
optimiser, precision, ZeRO stage, attention kernel and batching. Declarations only, beside
``config.py`` (which imports it and is at its length limit); it imports only configbase, as
``config.py`` does, and ``asyncrl.learner.attention`` (the standard library only) to check the
attention implementation when the config is read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config
from asyncrl.learner.attention import check_attn_implementation
from asyncrl.learner.offload_config import OffloadConfig, check_offload
from asyncrl.learner.zero3_config import Zero3Config


class TrainerConfig(Config):
    """Optimisation settings of the policy learner."""

    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0 (plain data parallel), 1 (optimizer states partitioned), 2 (+ gradients), 3 (+ parameters)."""
    lr: float = 1e-4
    """AdamW peak learning rate (after warm-up, before decay; see ``lr_schedule``)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or decayed linearly / by a half cosine to ``lr × min_lr_ratio`` at ``lr_decay_steps`` (``asyncrl.learner.lr_schedule``)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Optimizer updates of linear warm-up from lr / lr_warmup_steps to lr; 0: none."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Optimizer updates (warm-up included) at whose end the decay reaches its floor; None: the whole run, learner.total_steps × learner.ppo_epochs × learner.mini_batches."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The decay's floor as a fraction of ``lr`` (verl's ``min_lr_ratio``)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    fused_adamw: bool = True
    """PyTorch's fused AdamW kernel (CPU and CUDA): one pass over each parameter, no temporaries
    (with ``offload.optimizer_impl: deepspeed_cpu_adam``, DeepSpeed's own fused kernel instead).
    For 494 M fp32 parameters on one CPU core: 0.63 s and no memory beyond the moments a step,
    against 7.3 s and 3.7 GiB of temporaries for the default implementation. False: the default
    (for-each or per-tensor), whose rounding differs in the last bits."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value before each update; 0 disables clipping (the step stats report the norm before clipping and how often it was clipped)."""
    dtype: Literal["fp32", "bf16", "bf16_if_native"] = "fp32"
    """Training precision: fp32, or bf16 weights/activations with fp32 master weights in the
    optimizer, or bf16_if_native: bf16 where the learner's device multiplies it natively (GPUs of
    sm_80 and later, CPUs with AVX512-BF16 or AMX), fp32 elsewhere, where bf16 is emulated and
    ~30x slower (``asyncrl.models.precision``)."""
    temperature: float = 1.0
    """Sampling temperature of the generators: logits are divided by it so pi_theta is the sampled distribution (the learner process sets it from ``sampling.temperature``)."""
    top_k: int = 0
    """The generators' top-k, applied when scoring tokens so pi_theta is the sampled distribution; 0: off (set from ``sampling.top_k``)."""
    top_p: float = 1.0
    """The generators' top-p nucleus, applied likewise (``asyncrl.learner.logprobs``); 1: off (set from ``sampling.top_p``)."""
    logits_chunk_tokens: int = 512
    """Scored tokens per LM-head call: the learner never holds more than this many positions' logits (forward or backward)."""
    attn_implementation: str = "sdpa"
    """Hugging Face's attention kernel for every model the learner loads (the policy, the critic,
    the KL reference, the offline learners): sdpa, eager, flex_attention, flash_attention_2/3/4
    or a Hub kernel ``org/repo``; refused when the config is read if its package is not installed
    (``asyncrl.learner.attention``). Packed rows (``micro_batch_tokens``) are one row per micro
    batch under flash-attention, else as long as the step's longest sequence."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward instead of keeping them (less memory, ~1/3 more compute)."""
    zero_bucket_elements: int | None = Field(None, ge=1)
    """Elements per ZeRO gradient-reduce and all-gather bucket (DeepSpeed's reduce_bucket_size and allgather_bucket_size). None: DeepSpeed's 5e8, a 1 GB buffer in bf16 sized for GPUs; smaller saves host memory on one rank, larger means fewer collectives across ranks."""
    micro_batch_size: int = 64
    """Sequences per forward/backward; a bigger batch is accumulated over micro batches into one optimizer step."""
    micro_batch_tokens: int | None = None
    """Token slots per forward/backward, sequences packed several to a row (``asyncrl.learner.packing``); when set it wins over micro_batch_size. None: micro_batch_size sequences, each padded to the longest."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """Seconds a learner rank waits in a collective for the others before the group is restored
    from its last checkpoint (the error names the collective and where each rank was). It must
    exceed the longest one rank can be busy alone: rank 0 publishing the weights or waiting
    ``learner.batch_timeout_s`` for a batch; scale it with the model's publication time."""
    seed: int = 0
    """Seed of torch's RNG at start-up (dropout, if the model has any)."""
    offload: OffloadConfig = OffloadConfig()
    """Optimizer state and (ZeRO-3) parameters moved to host memory or NVMe files, and the AdamW that updates them there (``asyncrl.learner.offload``)."""
    zero3: Zero3Config = Zero3Config()
    """What ZeRO-3 gathers ahead of use and keeps gathered (DeepSpeed's ``stage3_*``); read only when zero_stage is 3."""

    @field_validator("zero_stage")
    @classmethod
    def _check_zero_stage(cls, v: int) -> int:
        if v not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage ({v}) must be 0, 1, 2 or 3")
        return v

    @field_validator("attn_implementation")
    @classmethod
    def _check_attn_implementation(cls, v: str) -> str:
        return check_attn_implementation(v)

    @field_validator("lr", "temperature")
    @classmethod
    def _check_positive(cls, v: float, info) -> float:
        if not v > 0:
            raise ValueError(f"{info.field_name} ({v}) must be > 0")
        return v

    @field_validator("weight_decay", "grad_clip")
    @classmethod
    def _check_non_negative(cls, v: float, info) -> float:
        if not v >= 0:
            raise ValueError(f"{info.field_name} ({v}) must be >= 0")
        return v

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas ({v}) must each be in [0, 1)")
        return v

    @field_validator("micro_batch_size", "logits_chunk_tokens")
    @classmethod
    def _check_at_least_one(cls, v: int, info) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} ({v}) must be >= 1")
        return v

    @field_validator("micro_batch_tokens")
    @classmethod
    def _check_micro_batch_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 2:
            raise ValueError(f"micro_batch_tokens ({v}) must be >= 2 or None")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k ({v}) must be >= 0 (0 = off)")
        return v

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p ({v}) must be in (0, 1]")
        return v

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainerConfig:
        decay, warmup = self.lr_decay_steps, self.lr_warmup_steps
        if self.lr_schedule != "constant" and decay is not None and decay <= warmup:
            raise ValueError(
                f"lr_decay_steps ({decay}) must be > lr_warmup_steps ({warmup}): the decay follows the warm-up"
            )
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> TrainerConfig:
        check_offload(self.offload, self.zero_stage, self.fused_adamw)
        return self
