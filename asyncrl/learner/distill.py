"""On-policy distillation: a per-token reverse-KL advantage from a teacher's log-probabilities.

The student samples answers y ~ mu (the generators: the behaviour policy, possibly some versions
stale); a teacher pi_T scores each sampled token (``asyncrl.rewards.teacher``, carried in
``Sample.teacher_logprobs``). The objective is the reverse KL of the student to the teacher on
the student's own samples (Agarwal et al. 2024, "On-Policy Distillation of Language Models",
GKD, eq. 3 with the reverse KL; Gu et al. 2024, "MiniLLM: Knowledge Distillation of Large
Language Models", eq. 1)::

    L(theta) = E_{x, y ~ pi_theta} [ sum_t KL(pi_theta(. | x, y_<t) || pi_T(. | x, y_<t)) ]

whose policy gradient, with the sampled token's log-ratio as the single-sample estimate of each
token's KL and no credit to later tokens, is REINFORCE with the per-token advantage::

    A_t^distill = -(log mu(y_t | x, y_<t) - log pi_T(y_t | x, y_<t))          (``distill_advantages``)

and the learner's advantage of token t is ``coef * A_t^distill``, plus the rewards' advantage
A_seq of ``algorithm.adv_estimator`` (``algorithm.distill.rewards``: true), or alone (false:
pure distillation). A token the teacher finds likelier than the student did is pushed up, one it
finds unlikelier pushed down; at pi_theta = pi_T every expected advantage is 0.

Where this differs from the references, and why:

- GKD computes each token's KL over the whole vocabulary, summing pi_theta(v) (log pi_theta(v) -
  log pi_T(v)) over v. The teacher here sends the sampled tokens' log-probabilities only (one
  float per token on the wire, not V), so the KL is the sampled token's log-ratio, an unbiased
  single-sample estimate of it (k1) — the estimator Thinking Machines' "on-policy distillation"
  (Lu et al. 2025) uses.
- MiniLLM credits token t with the sum of the log-ratios of the tokens from t on (the reverse KL
  of the sequence's remainder, with length normalisation), and adds a single-step term. Here each
  token is credited with its own log-ratio only (discount 0), as GKD's per-token loss and Lu et
  al. do: lower variance, and the later tokens' KL is still minimised at their own positions.
- The log-probability of the student in the advantage is the behaviour policy's, log mu (the
  generator's, as sampled), not the learner's log pi_theta, as in Lu et al.: the advantage is a
  fixed number per token, like a reward's, and goes through the same staleness-corrected policy
  loss (``asyncrl.learner.losses.compute_policy_loss``): under ``correction: decoupled`` each
  token's loss is -w_t * min(r_t A_t, clip(r_t) A_t) with r_t = pi_theta / pi_prox and the
  importance weight w_t = pi_prox / mu (capped at ``is_cap``) correcting for the tokens having been
  sampled by mu, exactly as for an advantage from rewards. A stale sample's log mu differs from
  the current policy's log-probability by the drift the staleness bound (``buffer.max_staleness``)
  limits; at staleness 0, mu = pi_theta and this is the on-policy estimate.

- ``algorithm.distill.baseline`` (off by default; none of the references has one) takes the
  batch's mean log-ratio out of every token's. A student far from its teacher has nearly every
  log-ratio negative: without it almost every sampled token is pushed down, and on the addition
  recipe here (``configs/distill_addition.yaml``) a run longer than ~120 steps, or at a 3x
  learning rate, fell back or collapsed (docs/how-to/distillation.md has the figures).

The replay buffer's per-group importance weights (``weighted_advantages``) scale the distillation
term as they scale the rewards' advantages.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.wire.schema import Group, sample_prompt_ids


def distill_advantages(
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
    clip: float | None = None,
    baseline: bool = False,
) -> torch.Tensor:
    """The per-token reverse-KL advantage, 0 off the mask::

        m_t = clip(log pi_T(y_t) - log mu(y_t), -clip, clip)
        A_t = coef * m_t                                  (baseline: coef * (m_t - mean of m over the mask))

    The baseline is a constant of the batch: E_{y_t ~ mu}[grad log pi(y_t)] = 0, so subtracting it
    leaves the expected gradient as it is (up to its O(1/N) dependence on each token) and lowers
    its variance when the student is far from the teacher and nearly every log-ratio is negative.
    Neither GKD, MiniLLM nor Lu et al. use one; it is off by default.

    Args:
        teacher_logprobs: (B, T) log pi_T of each sampled token.
        behaviour_logprobs: (B, T) log mu of the same tokens (the generator's).
        mask: (B, T) 1 on trained tokens.
        coef: the weight of the term (``algorithm.distill.coef``).
        clip: bound on each token's log-ratio before ``coef``; None: none.

    >>> distill_advantages(torch.tensor([[-0.1, -2.0]]), torch.tensor([[-0.5, -0.5]]), torch.ones(1, 2)).tolist()
    [[0.4000000059604645, -1.5]]
    """
    if not (teacher_logprobs.shape == behaviour_logprobs.shape == mask.shape):
        raise ValueError(
            f"teacher_logprobs {tuple(teacher_logprobs.shape)}, behaviour_logprobs "
            f"{tuple(behaviour_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    margin = teacher_logprobs - behaviour_logprobs  # (B, T): -(per-token reverse KL estimate)
    if clip is not None:
        margin = margin.clamp(-clip, clip)
    if baseline:
        margin = margin - (margin * mask).sum() / mask.sum().clamp(min=1)
    return coef * margin * mask


def teacher_rows(groups: list[Group], width: int) -> torch.Tensor:
    """(B, width) the samples' teacher log-probabilities in ``collate``'s layout (rows in order
    group, sample; response token j of a row with a P-token context at position P - 1 + j, the
    position that predicts it), 0 elsewhere. A sample without them is an error that names it."""
    rows = []
    for group in groups:
        for sample in group.samples:
            if sample.teacher_logprobs is None:
                raise ValueError(
                    f"sample {sample.uid}: no teacher_logprobs, which algorithm.distill needs (a reward of kind teacher)"
                )
            rows.append((len(sample_prompt_ids(group, sample)), sample.teacher_logprobs))
    out = np.zeros((len(rows), width), dtype=np.float32)
    for b, (P, values) in enumerate(rows):
        out[b, P - 1 : P - 1 + len(values)] = values
    return torch.from_numpy(out)


def add_distillation(algo: AlgorithmConfig, batch: TrainBatch, groups: list[Group], weights=None) -> None:
    """Add ``algorithm.distill``'s per-token advantage to ``batch.advantages`` (in place; with
    ``distill.rewards`` false it replaces them), scaled by each group's importance weight; nothing
    without ``algorithm.distill``. ``groups``: in the batch's order."""
    cfg = algo.distill
    if cfg is None:
        return
    teacher = teacher_rows(groups, batch.behaviour_logprobs.shape[1])  # (B, L-1)
    term = distill_advantages(teacher, batch.behaviour_logprobs, batch.response_mask, cfg.coef, cfg.clip, cfg.baseline)
    if weights is not None:
        term = term * torch.as_tensor(np.asarray(weights, np.float32))[batch.group_index][:, None]
    if not cfg.rewards:
        batch.advantages.zero_()
    batch.advantages += term
