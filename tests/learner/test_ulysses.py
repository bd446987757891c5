"""The sequence-parallel rules that need no second process: heads, masks, config."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.ulysses import check_heads, register_attention, row_mask, ulysses_attention


def test_kv_heads_repeat_by_the_smallest_factor_that_divides():
    assert check_heads(14, 2, 2) == 1  # Qwen2.5-0.5B on 2 ranks: one KV head each
    assert check_heads(14, 2, 7) == 7  # 7 ranks: each KV head 7 times, one per query head
    assert check_heads(4, 1, 2) == 2
    assert check_heads(16, 4, 8) == 2
    assert check_heads(12, 4, 6) == 3  # neither 6 | 4 nor 4 | 6 (DeepSpeed's rule): 12 = 4 x 3 serves
    with pytest.raises(ValueError, match=r"sequence_parallel \(4\) must divide the model's attention heads \(14\)"):
        check_heads(14, 2, 4)
    with pytest.raises(ValueError, match=r"KV heads \(4\), repeated 3 times .* attention heads \(6\)"):
        check_heads(6, 4, 6)  # 4 x 3 = 12 KV heads for 6 query heads


def test_row_mask_is_causal_within_each_packed_sequence():
    plain = torch.arange(6).expand(2, 6)
    assert row_mask(plain) is None  # one sequence per row: causal alone
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])  # sequences of 3, 2 and 1 tokens
    mask = row_mask(packed)[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for lo, hi in ((0, 3), (3, 5), (5, 6)):
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)


def test_outside_its_scope_the_attention_is_plain_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    register_attention()
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, _ = ulysses_attention(module, q, k, v, None, scaling=0.3)
    torch.testing.assert_close(out, sdpa_attention_forward(module, q, k, v, None, scaling=0.3)[0], rtol=0, atol=0)


def test_config_names_the_rule():
    assert LearnerConfig(ranks=4, sequence_parallel=2, batch_groups=2).data_parallel == 2
    with pytest.raises(ValueError, match=r"sequence_parallel \(3\) must divide learner.ranks \(4\)"):
        LearnerConfig(ranks=4, sequence_parallel=3)
    with pytest.raises(ValueError, match=r"\(4\) must be <= learner.batch_groups \(2\)"):
        LearnerConfig(ranks=4, batch_groups=2)
    LearnerConfig(ranks=4, sequence_parallel=4, batch_groups=1)  # one data-parallel rank: one group is enough


def test_the_run_config_refuses_what_sequence_parallelism_does_not_run():
    from asyncrl.config import load_config

    sp = ["learner.ranks=2", "learner.sequence_parallel=2"]
    assert load_config("configs/demo.yaml", sp).learner.data_parallel == 1
    with pytest.raises(ValueError, match=r"sequence_parallel \(2\) .* 'gae' .* needs learner.sequence_parallel 1"):
        load_config("configs/demo.yaml", [*sp, "algorithm.adv_estimator=gae", "algorithm.critic.lr=1e-4"])
