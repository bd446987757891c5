"""What an offline run minimises: the ``Objective`` interface and its two implementations.

An objective sees a micro batch of examples and, for each example's sequences, the policy's
log-probabilities of the tokens to learn (1-D tensors, with gradient). It returns its share of
the batch's loss and figures, both already divided by the whole batch's normaliser (over every
micro batch and rank: ``normaliser``), so the loop sums micro batches and ranks and gets the
batch's value, whatever the micro batching, packing or number of ranks.

- ``SFTObjective``: the token-mean negative log-likelihood of the assistant tokens,
  ``L = -(1/N) sum_i sum_t log pi(y_it | y_i<t)`` with N the batch's learned tokens (trl's
  default; a long answer weighs by its length).
- ``DPOObjective``: ``preference_loss`` (``asyncrl.learner.preference_losses``: sigmoid, ipo,
  hinge) of each pair, averaged over the batch's pairs; ``log pi(y|x)`` is the sum over the
  response's tokens (the mean for ipo, as trl does). The reference's log-probabilities come from
  ``reference`` (``asyncrl.learner.offline.reference``: computed once, cached). With
  ``sft_weight`` > 0 the chosen responses' token-mean NLL is added (RPO, Pang et al. 2024).
  Figures: ``reward_accuracy`` and ``reward_margin`` (the implicit reward
  ``beta (log pi - log pi_ref)`` of chosen over rejected), and both rewards' means.
"""

from __future__ import annotations

from typing import Protocol

import torch

from asyncrl.learner.offline.config import ObjectiveConfig
from asyncrl.learner.offline.data import Example
from asyncrl.learner.preference_losses import preference_loss


class Objective(Protocol):
    """A loss over a batch of examples, with its figures."""

    name: str

    def normaliser(self, batch: list[Example]) -> float:
        """The whole batch's denominator (every rank's examples): learned tokens, or pairs."""
        ...

    def loss(
        self, examples: list[Example], logprobs: list[list[torch.Tensor]], normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro batch's share of the loss and of each figure; ``logprobs[i][j]``: (T_ij,)
        the policy's log-probabilities of the learned tokens of ``examples[i].sequences[j]``."""
        ...


class SFTObjective:
    name = "sft"

    def normaliser(self, batch: list[Example]) -> float:
        return float(max(1, sum(sum(s.mask) for e in batch for s in e.sequences)))

    def loss(self, examples, logprobs, normaliser):
        flat = torch.cat([lp for seqs in logprobs for lp in seqs])  # (T,)
        loss = -flat.sum() / normaliser
        return loss, {"nll": float(loss.detach()), "tokens": float(flat.numel())}


class DPOObjective:
    """DPO and its variants on (chosen, rejected) pairs; ``reference[uid]`` is the pair's
    (log pi_ref(chosen), log pi_ref(rejected)), on the same scale (sum, or mean for ipo)."""

    name = "dpo"

    def __init__(self, cfg: ObjectiveConfig, reference: dict[str, tuple[float, float]] | None = None):
        self.cfg = cfg
        self.reference = reference or {}

    @property
    def length_normalised(self) -> bool:
        return self.cfg.loss_type == "ipo"

    def sequence_logprob(self, token_logprobs: torch.Tensor) -> torch.Tensor:
        """log pi(y|x) of one response from its tokens' (T,): the sum, or the mean for ipo."""
        total = token_logprobs.sum()
        return total / max(1, token_logprobs.numel()) if self.length_normalised else total

    def normaliser(self, batch: list[Example]) -> float:
        return float(max(1, len(batch)))

    def loss(self, examples, logprobs, normaliser):
        missing = [e.uid for e in examples if e.uid not in self.reference]
        if missing:
            raise KeyError(f"no reference log-probabilities for pairs {missing[:3]} (computed before training)")
        chosen = torch.stack([self.sequence_logprob(seqs[0]) for seqs in logprobs])  # (P,)
        rejected = torch.stack([self.sequence_logprob(seqs[1]) for seqs in logprobs])  # (P,)
        ref = torch.tensor([self.reference[e.uid] for e in examples], dtype=chosen.dtype)  # (P, 2)
        out = preference_loss(
            chosen, rejected, ref[:, 0], ref[:, 1], self.cfg.beta, self.cfg.loss_type, self.cfg.label_smoothing
        )
        loss = out.losses.sum() / normaliser
        figures = {
            "dpo_loss": float(loss.detach()),
            "reward_accuracy": float((out.chosen_rewards > out.rejected_rewards).float().sum()) / normaliser,
            "reward_margin": float((out.chosen_rewards - out.rejected_rewards).sum()) / normaliser,
            "chosen_reward": float(out.chosen_rewards.sum()) / normaliser,
            "rejected_reward": float(out.rejected_rewards.sum()) / normaliser,
        }
        if self.cfg.sft_weight > 0:
            # RPO: the chosen answers' token-mean NLL over the batch's pairs (each pair's mean, averaged).
            nll = torch.stack([-seqs[0].mean() for seqs in logprobs]).sum() / normaliser
            loss = loss + self.cfg.sft_weight * nll
            figures["chosen_nll"] = float(nll.detach())
        return loss, figures


def make_objective(cfg: ObjectiveConfig) -> SFTObjective | DPOObjective:
    return DPOObjective(cfg) if cfg.kind == "dpo" else SFTObjective()
