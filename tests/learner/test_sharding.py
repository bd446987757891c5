"""How a step's batch is cut between learner ranks, and how their figures are put together."""

from collections import Counter

import numpy as np

from asyncrl.learner.data_parallel import DataParallel
from asyncrl.learner.sharding import shard_plan
from asyncrl.learner.step_stats import merge_rank_figures
from asyncrl.wire.schema import Group, Sample


def group(index: int, *lengths: int) -> Group:
    samples = [
        Sample(f"g{index}/{i}", np.ones(n, np.int32), np.zeros(n, np.float32), "", "stop", 1.0)
        for i, n in enumerate(lengths)
    ]
    return Group(f"g{index}", f"p{index}", "t", "", "", np.ones(2, np.int32), 0, "gen", samples)


def test_one_rank_keeps_the_batch_as_it_is():
    groups = [group(0, 3, 4), group(1, 9, 9), group(2, 1, 1)]
    plan = shard_plan(groups, mini_batches=2, world=1)
    assert plan.order == [0, 1, 2]
    assert plan.minis == [(0, 4), (4, 6)]  # array_split: groups 0-1, then 2
    assert plan.shares == [[(0, 4)], [(4, 6)]]


def test_ranks_get_whole_groups_balanced_by_tokens_and_contiguous_rows():
    groups = [group(0, 5, 5), group(1, 1, 1), group(2, 2, 2), group(3, 4, 4, 4)]
    plan = shard_plan(groups, mini_batches=1, world=2)
    # tokens g0 10, g1 2, g2 4, g3 12; largest first to the lighter rank: g3 -> 0, g0 -> 1,
    # g2 -> 1 (10 < 12), g1 -> 0 (12 < 14): 14 tokens each, batch order within a rank
    assert plan.order == [1, 3, 0, 2]
    assert plan.minis == [(0, 9)]
    assert plan.shares == [[(0, 5), (5, 9)]]
    sizes = [len(g.samples) for g in groups]
    rows = [sizes[g] for g in plan.order]
    assert sum(rows) == 9  # every sample once


def test_a_rank_without_a_group_in_a_mini_batch_has_an_empty_share():
    groups = [group(0, 2, 2), group(1, 3, 3), group(2, 1, 1)]
    plan = shard_plan(groups, mini_batches=2, world=2)
    assert plan.minis == [(0, 4), (4, 6)]
    assert plan.shares[1] == [(4, 6), (6, 6)]  # mini-batch 1 holds one group: rank 1 has none
    assert plan.own(1) == [plan.shares[0][1]]


def test_rank_figures_sum_take_the_largest_weight_and_add_losses_update_by_update():
    rank0 = [
        Counter(tokens=10.0, kept=8.0, is_weight_max=2.0, lr=0.1, grad_norms=[1.0, 2.0], update_losses=[0.5, 0.25])
    ]
    rank1 = [
        Counter(tokens=5.0, clipped=1.0, is_weight_max=3.0, lr=0.1, grad_norms=[1.0, 2.0], update_losses=[0.25, 0.5])
    ]
    (merged,) = merge_rank_figures([rank0, rank1])
    assert merged["tokens"] == 15.0 and merged["kept"] == 8.0 and merged["clipped"] == 1.0
    assert merged["is_weight_max"] == 3.0 and merged["lr"] == 0.1 and merged["grad_norms"] == [1.0, 2.0]
    assert merged["update_losses"] == [0.75, 0.75]
    assert merge_rank_figures([rank0]) == rank0


def test_a_group_of_one_needs_no_collective():
    dp = DataParallel()
    assert dp.lead and dp.world == 1
    assert dp.broadcast("order", "x", 0) == "order" and dp.all_gather(1, "x", 0) == [1]
    with dp.collective("anything", 0):
        dp.barrier("x", 0)
