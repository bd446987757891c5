"""Declarations of online DPO's config (``algorithm.dpo``, ``OnlineDPOConfig``) and the check of
``algorithm.objective`` against the policy-gradient keys (``check_objective``), which
``AlgorithmConfig`` runs at load. Kept apart from ``config.py`` (one job: what online DPO
declares); like it, importing this imports no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config


class OnlineDPOConfig(Config):
    """Online DPO on the stream (``algorithm.objective: online_dpo``): each group's answers
    paired by reward, chosen against rejected, trained by a preference loss against the frozen
    starting weights (``asyncrl.learner.online_dpo``; the losses: ``asyncrl.learner.preference_losses``)."""

    beta: float = Field(0.1, gt=0)
    """The reference's pull: DPO's beta, IPO's tau (the implicit reward is beta (log pi_theta - log pi_ref))."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid (DPO, Rafailov et al. 2023), ipo (Azar et al. 2023) or hinge (SLiC, Zhao et al. 2023) on the pair's implicit reward margin."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """sigmoid only: the probability that a pair's label is flipped (conservative DPO, Mitchell 2023); 0: plain DPO."""
    length_normalise: bool | None = None
    """Take a response's log-probability as the mean of its token log-probabilities instead of their sum; None: true for ipo (as trl), false otherwise (the papers' sum)."""
    pairs: Literal["best_worst", "all"] = "best_worst"
    """best_worst: one pair per group, its best answer against its worst (the first of equal ones); all: every answer with the group's best reward against every one with its worst."""
    nll_coef: float = Field(0.0, ge=0)
    """Weight of the chosen answer's negative log-likelihood (its token mean) added to each pair's loss (RPO: Pang et al. 2024, "Iterative Reasoning Preference Optimization"; trl's rpo_alpha): keeps the chosen answers' likelihood from falling with the rejected ones'; 0: off."""
    min_reward_gap: float = Field(0.0, ge=0)
    """A group's best reward must exceed its worst by more than this to give a pair; 0: only exact ties (every answer scored alike) give none."""

    @property
    def normalise(self) -> bool:
        """Whether responses' log-probabilities are token means (``length_normalise`` resolved)."""
        return self.loss_type == "ipo" if self.length_normalise is None else self.length_normalise

    @model_validator(mode="after")
    def _check_smoothing(self) -> OnlineDPOConfig:
        if self.label_smoothing > 0 and self.loss_type != "sigmoid":
            raise ValueError(
                f"algorithm.dpo.label_smoothing ({self.label_smoothing}) applies to algorithm.dpo.loss_type "
                f"'sigmoid' only, not '{self.loss_type}'"
            )
        return self


POLICY_GRADIENT_ONLY = (
    "policy_loss",
    "loss_agg_mode",
    "kl_entropy_agg_mode",
    "loss_norm_tokens",
    "clip_low",
    "clip_high",
    "sapo_tau_pos",
    "sapo_tau_neg",
    "dual_clip",
    "correction",
    "correction_level",
    "is_cap",
    "mis_low",
    "mis_high",
    "rejection",
    "rejection_threshold",
    "is_batch_normalise",
    "proximal",
    "critic",
)
"""``algorithm`` keys of the policy-gradient loss: one off its default with ``objective: online_dpo`` is an error."""


def check_objective(algo) -> None:
    """Refuse the ``algorithm`` keys (``algo``: an ``AlgorithmConfig``, not imported here: this
    module is below ``asyncrl.learner.config``) that make no sense with its ``objective``, naming both:
    ``dpo`` off its defaults without online DPO; with it, the policy-gradient keys off theirs
    (``POLICY_GRADIENT_ONLY``), a critic (``gae``), a KL term and an entropy bonus."""
    if algo.objective != "online_dpo":
        if algo.dpo != OnlineDPOConfig():
            raise ValueError(
                f"algorithm.dpo is set but algorithm.objective is '{algo.objective}' (only 'online_dpo' uses it)"
            )
        return
    # Off their defaults, not "set": the run's resolved config (config.yaml) spells out every key.
    fields = type(algo).model_fields
    pg_keys = [key for key in POLICY_GRADIENT_ONLY if getattr(algo, key) != fields[key].default]
    if pg_keys:
        raise ValueError(
            f"algorithm.{pg_keys[0]} is a policy-gradient setting: algorithm.objective 'online_dpo' does not "
            "use it (remove it, or use objective policy_gradient)"
        )
    if algo.adv_estimator == "gae":
        raise ValueError(
            "algorithm.adv_estimator 'gae' trains a critic for per-token advantages: algorithm.objective "
            "'online_dpo' pairs whole answers by reward and uses neither"
        )
    if algo.kl.coef > 0:
        raise ValueError(
            f"algorithm.kl.coef ({algo.kl.coef}) adds a KL term, but algorithm.objective 'online_dpo' is already "
            "anchored to the reference by algorithm.dpo.beta: set kl.coef 0 (kl.reference still places the reference)"
        )
    if algo.entropy_coef > 0:
        raise ValueError(
            f"algorithm.entropy_coef ({algo.entropy_coef}) is a policy-gradient bonus: algorithm.objective "
            "'online_dpo' has no entropy term"
        )
