"""Preference losses, ``PREFERENCE_LOSSES`` by name: DPO and its variants on (chosen, rejected) pairs.

Every loss is a function of the implicit reward margin of a pair. With pi_theta the policy,
pi_ref the frozen reference and ``log pi(y|x)`` a response's summed token log-probabilities::

    h = (log pi_theta(y_w|x) - log pi_ref(y_w|x)) - (log pi_theta(y_l|x) - log pi_ref(y_l|x))

where y_w is the chosen response and y_l the rejected one. The losses, per pair:

- ``sigmoid`` — DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7):
  ``-log sigma(beta h)``. With ``label_smoothing`` eps > 0 it is conservative DPO (Mitchell 2023,
  "A note on DPO with noisy preferences"): ``-(1-eps) log sigma(beta h) - eps log sigma(-beta h)``,
  the loss of a label that is flipped with probability eps.
- ``ipo`` — IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
  Human Preferences", eq. 17, with tau = beta): ``(h - 1/(2 beta))^2``, a squared loss that stops
  pushing once the margin reaches 1/(2 beta) instead of driving it to infinity.
- ``hinge`` — SLiC's calibration loss (Zhao et al. 2023, "SLiC-HF", eq. 1: ``max(0, delta -
  log P(y_w|x) + log P(y_l|x))``) taken on the log-ratios to the reference, with delta = 1/beta and
  scaled by beta, as trl's ``hinge``: ``max(0, 1 - beta h)``. SLiC itself adds a regulariser
  instead of a reference; the ratio form keeps beta's role the same across the three losses.

What the caller passes as ``log pi(y|x)`` is its choice: the paper's sum over the response's
tokens for DPO and hinge. For IPO, trl averages the token log-probabilities over the response
(``length_normalise`` in the offline and online trainers); the paper's derivation holds for any
fixed definition of the policy's preference, and the average keeps 1/(2 beta) meaningful across
response lengths.

Alongside the loss, the implicit rewards ``beta (log pi_theta - log pi_ref)`` of the chosen and
rejected responses (DPO section 5: the reward the policy implicitly optimises), whose mean
margin and the fraction of pairs where the chosen one's is higher (``accuracy``) are the figures
trl and OpenRLHF report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreferenceLoss:
    """A batch of pairs' losses and implicit rewards, each (P,) for P pairs."""

    losses: torch.Tensor
    """Per-pair loss (with gradient where the policy's log-probabilities have one)."""
    chosen_rewards: torch.Tensor
    """beta (log pi_theta(y_w|x) - log pi_ref(y_w|x)), detached."""
    rejected_rewards: torch.Tensor
    """beta (log pi_theta(y_l|x) - log pi_ref(y_l|x)), detached."""

    @property
    def accuracy(self) -> float:
        """The fraction of pairs whose chosen response has the higher implicit reward."""
        return float((self.chosen_rewards > self.rejected_rewards).float().mean()) if self.losses.numel() else 0.0

    @property
    def margin(self) -> float:
        """The mean implicit reward margin, chosen minus rejected."""
        return float((self.chosen_rewards - self.rejected_rewards).mean()) if self.losses.numel() else 0.0


def sigmoid_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7), conservative with ``label_smoothing`` > 0 (Mitchell 2023)."""
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def ipo_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17, tau = beta): the margin regressed onto 1/(2 beta)."""
    del label_smoothing  # IPO's target already bounds the margin; a flipped label has no analogue here
    return (h - 1 / (2 * beta)) ** 2


def hinge_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """SLiC's hinge on the log-ratio margin (Zhao et al. 2023, eq. 1, delta = 1/beta, scaled by beta)."""
    del label_smoothing
    return torch.relu(1 - beta * h)


PREFERENCE_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "sigmoid": sigmoid_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
}
"""The losses by ``loss_type``; each maps the margin h (P,), beta and label smoothing to (P,) losses."""


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """The ``loss_type`` loss of P pairs from their responses' log-probabilities, each (P,).

    ``policy_*`` are log pi_theta(y|x) (with gradient), ``ref_*`` log pi_ref(y|x) (no gradient is
    taken through them). ``beta`` > 0 is the strength of the reference's pull (DPO's beta, IPO's
    tau); ``label_smoothing`` in [0, 0.5) only affects ``sigmoid``.

    >>> import torch
    >>> out = preference_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    >>> round(float(out.losses[0]), 4)  # -log sigma(0.5 * ((-1 + 2) - (-3 + 2))) = -log sigma(1)
    0.3133
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {sorted(PREFERENCE_LOSSES)}")
    if not beta > 0:
        raise ValueError(f"beta ({beta}) must be > 0")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing ({label_smoothing}) must be in [0, 0.5)")
    shapes = {t.shape for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1:
        raise ValueError(f"the four log-probability tensors must have one shape, got {sorted(map(tuple, shapes))}")
    chosen_logratio = policy_chosen - ref_chosen.detach()
    rejected_logratio = policy_rejected - ref_rejected.detach()
    losses = PREFERENCE_LOSSES[loss_type](chosen_logratio - rejected_logratio, beta, label_smoothing)
    return PreferenceLoss(
        losses=losses,
        chosen_rewards=beta * chosen_logratio.detach(),
        rejected_rewards=beta * rejected_logratio.detach(),
    )
