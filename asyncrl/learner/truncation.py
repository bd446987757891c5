"""Answers cut off at the length limit (``finish_reason == "length"``): what training does with them.

A truncated answer never reached its end, so its reward scores a text the policy did not finish:
usually 0 for a correct-but-long derivation, which teaches "shorter" and "wrong" alike. The
``algorithm.truncation.mode`` chooses (see ``TruncationConfig``):

- ``keep``: train on it like any other answer (verl's, OpenRLHF's and trl's default);
- ``mask``: keep it in its group (its reward still counts in the group's baseline) but take its
  tokens out of the loss: DAPO's overlong filtering (Yu et al. 2025, section 3.4);
- ``penalise``: DAPO's soft overlong punishment (eq. 13), added to the reward of *every* answer
  by its length before the advantages, ``overlong_penalty`` below;
- ``drop``: the buffer drops the whole group on arrival, counted under the reason ``truncated``
  (the buffer is group-atomic, and a group's baseline needs all its samples).

The penalty is reward shaping in the learner, beside the KL reward penalty, rather than in the
reward workers: the workers score the task (what the reward curves and evaluation compare), and
an external reward service need not know the sampling limit.
"""

from __future__ import annotations

import numpy as np

from asyncrl.wire.schema import Group


def overlong_penalty(lengths, max_tokens: int, cache_tokens: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``penalty``:

                     ⎧ 0                               |y| ≤ L_max − L_cache
        R_length(y) = ⎨ ((L_max − L_cache) − |y|) / L_cache    L_max − L_cache < |y| ≤ L_max
                     ⎩ −1                              L_max < |y|

    with L_max = ``max_tokens`` and L_cache = ``cache_tokens``; returns ``penalty · R_length`` per
    answer, to be added to its reward. A truncated answer (|y| = L_max) gets −penalty.
    """
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(f"cache_tokens ({cache_tokens}) must be in (0, max_tokens ({max_tokens})]")
    y = np.asarray(lengths, dtype=np.float64)
    expected = max_tokens - cache_tokens
    r = np.clip((expected - y) / cache_tokens, -1.0, 0.0)
    return (penalty * r).astype(np.float32)


def is_truncated(group: Group) -> np.ndarray:
    """(n,) bool: which samples of ``group`` stopped at the length limit."""
    return np.array([s.finish_reason == "length" for s in group.samples], dtype=bool)
