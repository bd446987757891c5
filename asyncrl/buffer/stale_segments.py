"""Partial rollouts at the buffer: stale segments leave the loss instead of the whole group.

A sample whose answer spans weight updates carries ``version_segments``; its oldest tokens can be
past the staleness bound S (``buffer.max_staleness``) while its newest are not. With
``generator.partial_rollouts`` ``mask`` (or ``resume``):

- the gate measures a group's staleness from its *newest* segment (``gate_version``): it drops the
  group (reason ``stale``) only when no token of it could be trained within the bound, so the
  oldest segment that *is* trained is always within it;
- each hand-out marks, per sample, the first token within the bound (``mark_trained_from``):
  with the learner at version v, token t is trained when ``v - version(t) <= S``. The tokens
  before it stay in the sequence as context (the learner still conditions on them) but are out
  of the loss; a sample with no token left to train (``trained_from == len``) is counted by the
  learner as dropped, reason ``stale``.

Why the buffer decides and not the generator: staleness is the learner's version *at the
update* minus the token's, and only the buffer, handing a batch to a request that states the
version the learner will train it at, knows both. A generator sending a group cannot know how
many learner steps it will wait in the buffer, so a mask decided there would be a guess; here
the mask and the gate use the same version and the same bound, and agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncrl.wire.schema import Group, token_versions


def newest_version(group: Group) -> int:
    """The newest version that sampled any token of ``group`` (its samples' last segments)."""
    return max(
        [group.policy_version] + [s.version_segments[-1][1] for s in group.samples if s.version_segments],
    )


def gate_version(group: Group, partial_rollouts: str) -> int:
    """The version the staleness gate measures ``group`` from: its oldest token's
    (``policy_version``) when partial rollouts are off, its newest segment's when stale segments
    are masked instead (``mask``, ``resume``)."""
    return group.policy_version if partial_rollouts == "off" else newest_version(group)


@dataclass
class MaskCounts:
    """What one hand-out masked."""

    tokens: int = 0
    """Tokens out of the loss (kept as context)."""
    samples: int = 0
    """Samples with every token out of the loss."""


def mark_trained_from(groups: list[Group], learner_version: int, max_staleness: int | None) -> MaskCounts:
    """Set each sample's ``trained_from`` to its first token sampled within ``max_staleness`` of
    ``learner_version`` (``len(response_ids)`` when none is); None: no bound, every token trained.
    Set afresh on every hand-out (a group handed out again, at a later version, masks more)."""
    counts = MaskCounts()
    for group in groups:
        for sample in group.samples:
            n = len(sample.response_ids)
            if max_staleness is None or n == 0:
                sample.trained_from = 0
                continue
            fresh = learner_version - token_versions(sample, group.policy_version) <= max_staleness  # (T,)
            # versions increase along an answer, so the fresh tokens are a suffix
            sample.trained_from = int(np.argmax(fresh)) if fresh.any() else n
            counts.tokens += sample.trained_from
            counts.samples += sample.trained_from == n
    return counts
