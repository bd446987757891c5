"""Which rows of a step's batch each learner rank trains: whole groups, balanced by tokens.

With ``learner.ranks: N`` every rank holds the *whole* batch (rank 0 receives it from the
buffer and sends it to the others, ``asyncrl.learner.data_parallel``), computes everything that
is a statistic of the batch — advantages (group and batch estimators), the loss's normalisers
(the mini-batch's response tokens and sequences, the Dr. GRPO constant) — from all of it, and
runs forward and backward passes only on its own share. Each rank's share of a mini-batch's loss
is its token sum divided by the *whole* mini-batch's normaliser, and DeepSpeed averages the
ranks' gradients, so each rank's loss is scaled by N: the sum over ranks is then exactly the
one-rank loss, in every aggregation mode, whatever the ranks' token counts (uneven is the
normal case).

``shard_plan`` cuts each mini-batch (a run of whole groups, ``step.mini_batch_bounds``) into N
shares of whole groups, by longest-processing-time first on response tokens (each group, largest
first, to the rank with the fewest tokens so far), and reorders the batch so that, within each
mini-batch, rank 0's groups come first, then rank 1's: every rank's share of a mini-batch is then
one contiguous run of rows. The reorder changes nothing a loss sees (the group estimators are
per group, the batch estimators and the normalisers are sums over the batch); with one rank it is
the identity.

Under sequence parallelism (``learner.sequence_parallel: S``) the shares are the data-parallel
ranks' (N = ranks / S of them): the S ranks of a sequence-parallel group train the same share,
each on its own positions of every row (``asyncrl.learner.ulysses``).

Why every rank gets the whole batch rather than only its slice: the batch is token ids and a few
floats per token (kilobytes to a few megabytes), against the model's gigabytes per step, and
with the whole batch at hand the batch statistics need no collective of their own and cannot
disagree between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncrl.wire.schema import Group


@dataclass(frozen=True)
class ShardPlan:
    """The step's batch, reordered, and each rank's rows of each mini-batch."""

    order: list[int]
    """The groups' new order: ``groups[order[i]]`` is the reordered batch's group i."""
    minis: list[tuple[int, int]]
    """Row ranges of the mini-batches in the reordered batch (the normalisers' ranges)."""
    shares: list[list[tuple[int, int]]]
    """``shares[m][r]``: rank r's rows of mini-batch m (empty, ``lo == hi``, when it has no group)."""

    def own(self, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s non-empty row ranges, over every mini-batch."""
        return [share[rank] for share in self.shares if share[rank][1] > share[rank][0]]


def shard_plan(groups: list[Group], mini_batches: int, world: int) -> ShardPlan:
    """Each rank's whole groups of each of the ``mini_batches`` mini-batches (see the module doc);
    ``tests/learner/test_sharding.py`` shows the cuts."""
    bounds = np.array_split(np.arange(len(groups)), min(mini_batches, len(groups)))
    order: list[int] = []
    minis: list[tuple[int, int]] = []
    shares: list[list[tuple[int, int]]] = []
    row = 0
    for members in bounds:
        tokens = {int(g): sum(len(s.response_ids) for s in groups[g].samples) for g in members}
        load, assigned = [0] * world, [[] for _ in range(world)]
        for g in sorted(members, key=lambda g: (-tokens[int(g)], int(g))):
            rank = min(range(world), key=lambda r: (load[r], r))
            load[rank] += tokens[int(g)]
            assigned[rank].append(int(g))
        start, share = row, []
        for rank_groups in assigned:
            lo = row
            for g in sorted(rank_groups):  # batch order within a rank: one rank is the identity
                order.append(g)
                row += len(groups[g].samples)
            share.append((lo, row))
        minis.append((start, row))
        shares.append(share)
    return ShardPlan(order, minis, shares)
