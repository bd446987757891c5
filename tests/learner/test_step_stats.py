"""The step figures that ``buffer.max_staleness: auto`` steers by: KL per staleness, by hand."""

from collections import Counter

import pytest
import torch

from asyncrl.learner.step_stats import add_kl_by_staleness, kl_by_staleness, merge_rank_figures


def test_kl_is_summed_per_staleness_of_rows_or_tokens_and_merged_over_ranks():
    k3 = torch.tensor([[0.1, 0.3, 9.0], [0.2, 0.2, 0.2], [0.5, 0.5, 0.5]])  # (b, l-1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # the 9.0 and row 3 are off
    sums = Counter()
    add_kl_by_staleness(sums, k3, mask, torch.tensor([2, 0, 5]))
    assert kl_by_staleness(sums) == {0: pytest.approx(0.2), 2: pytest.approx(0.2)}  # no tokens at 5: absent
    # per-token staleness (a sample spanning a weight update): each token counts at its own
    per_token = Counter()
    add_kl_by_staleness(per_token, k3, mask, torch.tensor([[3, 1, 1], [1, 1, 1], [0, 0, 0]]))
    assert kl_by_staleness(per_token) == {1: pytest.approx((0.3 + 0.6) / 4), 3: pytest.approx(0.1)}
    merged = merge_rank_figures([[sums], [per_token]])[0]
    assert kl_by_staleness(merged) == {
        0: pytest.approx(0.2),
        1: pytest.approx(0.9 / 4),
        2: pytest.approx(0.2),
        3: pytest.approx(0.1),
    }
