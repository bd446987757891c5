"""Config of the learner process: the loop (``LearnerConfig``) and the trainer (``TrainerConfig``).

Kept apart from ``trainer.py`` so that reading a config never imports torch or DeepSpeed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncrl.configbase import Config


class TrainerConfig(Config):
    """Optimisation settings of the policy learner."""

    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0 (plain data parallel), 1 (optimizer states partitioned), 2 (+ gradients), 3 (+ parameters)."""
    lr: float = 1e-4
    """AdamW learning rate (constant; no schedule)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value before the step; 0 disables clipping."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Training precision: fp32, or bf16 weights/activations with fp32 master weights in the optimizer."""
    loss: Literal["decoupled_ppo"] = "decoupled_ppo"
    """Policy loss, a name in ``asyncrl.learner.losses.LOSSES``."""
    clip_coef: float = 0.2
    """PPO clip epsilon around the proximal policy."""
    behaviour_weight_cap: float | None = 5.0
    """Truncate the staleness importance weight pi_prox / mu at this value (>= 1); None: no truncation."""
    scale_advantages_by_std: bool = True
    """GRPO advantages divided by the group's reward std (True) or only centred (False, Dr. GRPO)."""
    temperature: float = 1.0
    """Sampling temperature of the generators: logits are divided by it so pi_theta is the sampled distribution."""
    micro_batch_size: int = 64
    """Sequences per forward/backward; a bigger batch is accumulated over micro batches into one optimizer step."""
    seed: int = 0
    """Seed of torch's RNG at start-up (dropout, if the model has any)."""

    @field_validator("zero_stage")
    @classmethod
    def _check_zero_stage(cls, v: int) -> int:
        if v not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage ({v}) must be 0, 1, 2 or 3")
        return v

    @field_validator("lr", "temperature", "clip_coef")
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

    @field_validator("behaviour_weight_cap")
    @classmethod
    def _check_cap(cls, v: float | None) -> float | None:
        if v is not None and v < 1:
            raise ValueError(f"behaviour_weight_cap ({v}) must be >= 1 or None")
        return v

    @field_validator("micro_batch_size")
    @classmethod
    def _check_micro_batch_size(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"micro_batch_size ({v}) must be >= 1")
        return v


class LearnerConfig(Config):
    total_steps: int = Field(100, ge=1)
    """Optimizer steps to train (the final policy version)."""
    batch_groups: int = Field(16, ge=1)
    """Groups (prompts) per optimizer step; samples per step = batch_groups × sampling.n."""
    broadcast_every: int = Field(2, ge=1)
    """Publish weights to the generators every this many optimizer steps."""
    batch_timeout_s: float = Field(5.0, gt=0)
    """Seconds one request for a batch waits before it is asked again (and the wait logged)."""
    trainer: TrainerConfig = TrainerConfig()
    """The DeepSpeed engine and the loss."""
