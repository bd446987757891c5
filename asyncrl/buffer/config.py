"""``BufferConfig``: every knob of the replay buffer, checked when it is built.

Kept apart from the buffer's code so that reading a config imports nothing heavy, and so that the
combination rules (a reuse ratio no group can satisfy, an error band that would deadlock) fail at
load time with the value and the rule, not as a stalled run.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config


class ZeroVarianceConfig(Config):
    """The buffer's zero-variance filter (``buffer.zero_variance``, ``asyncrl.buffer.zero_variance``):
    DAPO's dynamic sampling."""

    drop: bool = False
    """Drop a group whose answers all score alike (reason ``zero_variance``); the dispatcher hands
    a new prompt out in its place. Only for group-relative advantages (a config check refuses
    ``remax``, ``reinforce_pp`` and ``gae``, whose advantages of such a group are not 0)."""
    tolerance: float = Field(0.0, ge=0)
    """Rewards are alike when their population standard deviation is at most this; 0: exactly
    equal (verl's and DAPO's rule). Above 0 also drops a reward model's near-ties."""
    reward: str | None = None
    """Which score must vary: None, the combined reward (verl's ``score``); or a reward's name in
    ``reward.rewards`` (its part of each sample, e.g. ``exact_match``: verl's ``acc``)."""


class AutoStalenessConfig(Config):
    """Limits of the staleness controller of ``buffer.max_staleness: auto``
    (``asyncrl.learner.staleness_control``): the learner raises the bound while the off-policy
    signals of its steps stay well inside ``ess_min`` and ``kl_max``, and lowers it when one breaks."""

    min: int = Field(1, ge=0)
    """Lowest bound the controller sets (0: it may go synchronous)."""
    max: int = Field(16, ge=0)
    """Highest bound the controller sets; groups dispatched before a lowering were admitted under at most this."""
    start: int = Field(4, ge=0)
    """The bound of the first steps (and of a resumed run that had none saved), within [min, max]."""
    ess_min: float = Field(0.5, gt=0, le=1)
    """Lowest acceptable effective sample size of a step's raw importance weights w = pi_prox / mu,
    (Σw)² / (N·Σw²) over its response tokens (1: on-policy)."""
    kl_max: float = Field(0.05, gt=0)
    """Highest acceptable behaviour KL (k3 estimate of KL(mu ‖ pi_prox), per token) of a step's
    stalest samples; set it above the engines' own mismatch (``mismatch_kl``), or the bound only falls."""
    margin: float = Field(0.5, gt=0, lt=1)
    """Hysteresis: a step counts towards a raise only while kl ≤ margin·kl_max and
    1 − ess ≤ margin·(1 − ess_min); between that and the limits the bound holds."""
    raise_after: int = Field(4, ge=1)
    """Consecutive healthy steps whose stalest samples reached the bound before it goes up by one."""
    lower_after: int = Field(1, ge=1)
    """Consecutive steps breaking a limit before the bound is lowered."""
    decrease: float = Field(0.5, gt=0, lt=1)
    """A lowering multiplies the bound by this (rounded down; at least one lower, never below ``min``)."""

    @model_validator(mode="after")
    def _check_limits(self) -> AutoStalenessConfig:
        if not self.min <= self.start <= self.max:
            raise ValueError(f"auto_staleness.start ({self.start}) must be within [min ({self.min}), max ({self.max})]")
        return self


class BufferConfig(Config):
    capacity_samples: int = Field(4096, ge=1)
    """Samples held at most; past it the oldest groups are evicted (reason ``evicted``), the buffer never grows."""
    capacity_bytes: int = Field(1 << 30, ge=1)
    """Bytes of token ids and logprobs held at most; past it the oldest groups are evicted."""
    sampler: Literal["prioritized", "uniform", "fifo"] = "prioritized"
    """Which groups a batch takes: ``prioritized`` (P(i) = p_i^α / Σ p_k^α), ``uniform``, or ``fifo`` (oldest first)."""
    priority: Literal["reward_variance", "learnability", "mean_abs_advantage", "uniform"] = "reward_variance"
    """Priority of a group when it arrives, from its rewards (see ``asyncrl.buffer.priorities``)."""
    priority_floor: float = Field(0.01, gt=0)
    """Smallest priority a group can have, so that no group (long answers, hard prompts) is starved."""
    recency_decay: float = Field(1.0, gt=0, le=1)
    """Priorities are multiplied by recency_decay^(learner_version - policy_version); 1 disables the decay."""
    alpha: float = Field(0.6, ge=0, le=1)
    """Prioritization exponent α: 0 samples uniformly, 1 in proportion to the priority."""
    beta: float = Field(0.4, ge=0, le=1)
    """Importance-weight exponent β at the first batch: w_i = (N·P(i))^-β / max_j w_j."""
    beta_final: float = Field(1.0, ge=0, le=1)
    """β reached after ``beta_anneal_batches`` batches (linear in between); 1 fully corrects the bias."""
    beta_anneal_batches: int = Field(1000, ge=1)
    """Batches sampled over which β moves linearly from ``beta`` to ``beta_final``."""
    max_times_sampled: int | None = Field(1, ge=1)
    """Remove a group after it has been sampled this many times (1: use once); None keeps it until evicted."""
    max_staleness: Annotated[int, Field(ge=0)] | Literal["auto"] | None = 4
    """Drop groups more than this many versions behind the learner; None keeps all; ``auto``: the
    learner sets the bound step by step within ``auto_staleness``, from its off-policy signals."""
    auto_staleness: AutoStalenessConfig = AutoStalenessConfig()
    """The controller's limits under ``max_staleness: auto`` (unused otherwise)."""
    min_size_to_sample: int = Field(1, ge=1)
    """Groups the buffer must hold before any batch is handed out (Reverb's MinSize)."""
    samples_per_insert: float | None = Field(None, gt=0)
    """Target times each group is sampled (Reverb's SampleToInsertRatio); None: no ratio is enforced."""
    error_buffer: float = Field(64.0, gt=0)
    """Groups by which samples may run ahead of or behind ``samples_per_insert`` × inserts before one side blocks."""
    zero_variance: ZeroVarianceConfig = ZeroVarianceConfig()
    """Drop groups whose answers all score alike (DAPO's dynamic sampling; off by default)."""
    seed: int = 0
    """Seed of the sampler's random draws."""
    kernel: Literal["auto", "numba", "numpy"] = "auto"
    """How the prioritized and uniform samplers' sum tree runs: ``numba``, its batch operations
    compiled (``asyncrl.buffer.compiled_tree``: ~2x faster steps; the first start after an install
    compiles for 10–20 s, later ones load numba's cache in < 1 s); ``numpy``; ``auto``: numba when
    it imports, else numpy. Both draw the same batches and weights for a seed."""
    snapshot_on_exit: bool = False
    """Write the buffer's whole state to ``RUN_DIR/buffer_snapshot`` when the buffer process stops."""

    @property
    def auto(self) -> bool:
        """Whether the learner sets the staleness bound (``max_staleness: auto``)."""
        return self.max_staleness == "auto"

    @property
    def initial_staleness(self) -> int | None:
        """The bound a run starts with: ``max_staleness``, or ``auto_staleness.start`` under auto."""
        return self.auto_staleness.start if self.max_staleness == "auto" else self.max_staleness

    @property
    def staleness_ceiling(self) -> int | None:
        """The largest bound the run can have: ``max_staleness``, or ``auto_staleness.max`` under auto."""
        return self.auto_staleness.max if self.max_staleness == "auto" else self.max_staleness

    @model_validator(mode="after")
    def _check_combinations(self) -> BufferConfig:
        if self.beta_final < self.beta:
            raise ValueError(f"beta_final ({self.beta_final}) must be >= beta ({self.beta}): β anneals upwards")
        spi = self.samples_per_insert
        if spi is not None:
            if self.max_times_sampled is not None and spi > self.max_times_sampled:
                raise ValueError(
                    f"samples_per_insert ({spi}) must be <= max_times_sampled ({self.max_times_sampled}): "
                    "a group cannot be sampled more often than it is kept"
                )
            # Reverb's rule: a band narrower than one step of either side blocks both for good.
            if self.error_buffer < max(1.0, spi):
                raise ValueError(
                    f"error_buffer ({self.error_buffer}) must be >= max(1, samples_per_insert) = {max(1.0, spi)}, "
                    "or inserts and samples can block each other forever"
                )
        return self
