"""Sequence packing: micro batches within the token budget, attention never across sequences
(Hugging Face's packed-sequence masks, checked, not trusted), scores equal to the padded layout's."""

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM  # noqa: F401  imported at collection, not charged to the first test (~4 s)

from asyncrl.learner.batch import collate
from asyncrl.learner.logprobs import token_scores
from asyncrl.learner.packing import pack, plan_micro_batches
from asyncrl.wire.schema import Group, Sample
from tests.factories import small_qwen2

torch.set_num_threads(1)
VOCAB = 40


def make_model(attn: str):
    return small_qwen2(VOCAB, attn=attn)


def make_batch(lengths, seed=0):
    """One group per (prompt, response) length pair; behaviour logprobs and advantages arbitrary."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, (P, T) in enumerate(lengths):
        sample = Sample(f"{g}", rng.integers(1, VOCAB, T).astype(np.int32), -np.ones(T, np.float32), "", "stop", 0.0)
        groups.append(Group(f"{g}", f"{g}", "t", "", "", rng.integers(1, VOCAB, P).astype(np.int32), 0, "x", [sample]))
    return collate(groups, [[1.0]] * len(groups), pad_id=0)


def test_plan_fills_rows_by_first_fit_within_the_budget():
    lengths = [9, 3, 4, 2, 8, 1, 5, 5, 7, 2]
    plans = plan_micro_batches(lengths, micro_batch_size=4, micro_batch_tokens=20)
    assert [(p.lo, p.hi) for p in plans][0][0] == 0 and plans[-1].hi == len(lengths)
    assert all(a.hi == b.lo for a, b in zip(plans, plans[1:]))  # contiguous, in order, every sequence once
    for plan in plans:
        assert plan.row_tokens == 9 and plan.num_rows <= 20 // 9 and plan.capacity == plan.num_rows * 9
        assert plan.capacity <= 20 and plan.tokens == sum(lengths[plan.lo : plan.hi])
        used = {}
        for seq, (row, offset) in zip(range(plan.lo, plan.hi), plan.placement):
            assert offset == used.get(row, 0) and offset + lengths[seq] <= plan.row_tokens  # back to back, fits
            used[row] = offset + lengths[seq]
    # first fit: 9 | 3 4 2 -> row 1 full at 9 after 3+4+2, then 8 opens a new micro batch (2 rows max)
    assert plans[0].placement == [(0, 0), (1, 0), (1, 3), (1, 7)]
    padded = plan_micro_batches(lengths, micro_batch_size=4, micro_batch_tokens=None)
    assert [(p.lo, p.hi) for p in padded] == [(0, 4), (4, 8), (8, 10)] and padded[0].capacity == 4 * 9
    assert padded[0].placement is None
    waste = 1 - sum(p.tokens for p in plans) / sum(p.capacity for p in plans)
    assert waste < 1 - sum(p.tokens for p in padded) / sum(p.capacity for p in padded)
    # a budget below the longest sequence: one row per micro batch
    assert all(p.num_rows == 1 for p in plan_micro_batches(lengths, 4, 5))
    # rows longer than the longest sequence (flash-attention): one row of the budget
    (single,) = plan_micro_batches([9, 3, 4, 2], 4, 20, row_tokens=20)
    assert single.num_rows == 1 and single.placement == [(0, 0), (0, 9), (0, 12), (0, 16)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hugging_face_packed_rows_attend_within_each_sequence_only(attn):
    """The logits of every sequence in a packed row (position ids restarting, no attention mask)
    equal those of the sequence run alone: no attention crosses a boundary."""
    model = make_model(attn).eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (5, 3, 1, 4)]
    row = torch.cat(seqs + [torch.zeros(2, dtype=torch.long)])[None]  # 2 trailing pads
    positions = torch.cat([torch.arange(len(s)) for s in seqs] + [torch.arange(2)])[None]
    with torch.no_grad():
        packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[0]
        offset = 0
        for s in seqs:
            alone = model(input_ids=s[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[offset : offset + len(s)], alone, rtol=0, atol=1e-5)
            offset += len(s)
        # the same row without position ids is one sequence: the later ones see the earlier
        crossed = model(input_ids=row, use_cache=False).logits[0]
        assert (crossed[5:8] - model(input_ids=seqs[1][None], use_cache=False).logits[0]).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_scores_and_gradients_equal_the_padded_ones(attn):
    model = make_model(attn)
    batch = make_batch([(3, 6), (2, 2), (4, 1), (1, 5), (5, 4), (2, 7), (1, 2), (1, 1), (2, 1)])
    weights = torch.randn(batch.response_mask.shape)
    lengths = batch.attention_mask.sum(dim=1).tolist()

    padded = token_scores(model, batch.input_ids, batch.attention_mask, batch.response_mask, chunk_tokens=4)
    ((padded.logprobs * weights).sum() + (padded.entropy * weights).sum()).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    (plan,) = plan_micro_batches(lengths, micro_batch_size=64, micro_batch_tokens=54)
    assert plan.num_rows < len(lengths)  # several sequences share a row
    rows = pack(batch.input_ids, batch.attention_mask, batch.response_mask, plan, pad_id=0)
    scores = token_scores(model, rows.input_ids, None, rows.score_mask, position_ids=rows.position_ids, chunk_tokens=4)
    logprobs = rows.unpack(scores.logprobs, batch.response_mask)
    entropy = rows.unpack(scores.entropy, batch.response_mask)
    ((logprobs * weights).sum() + (entropy * weights).sum()).backward()

    assert rows.score_mask.sum() == batch.response_mask.sum()
    torch.testing.assert_close(logprobs, padded.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, padded.entropy, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
