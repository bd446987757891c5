"""Micro batches by a token budget, several sequences packed per row for the forward pass.

A batch of RL answers varies in length: padded to the longest, most of a row can be padding
(computed, then thrown away). With ``learner.trainer.micro_batch_tokens`` set,
``plan_micro_batches`` cuts the step's sequences (in batch order) into micro batches of at most
``micro_batch_tokens // row_tokens`` rows of ``row_tokens`` slots each, and places each sequence
by first fit into a row with room (a new row when none has room, a new micro batch when the rows
are used up). A micro batch therefore computes at most ``micro_batch_tokens`` token slots (at
least one row: a budget below the longest sequence gives one row per micro batch).

The row length follows the attention kernel (``learner.trainer.attn_implementation``,
``asyncrl.learner.attention.varlen_attention``). Eager and SDPA attention compute a dense
(row x row) score matrix under the block-diagonal mask, so rows are as long as the step's
longest sequence: no row costs more attention than in the padded layout, and short answers
share a row. Flash-attention's variable-length kernel costs only the sum of the sequences'
squares, so there a micro batch is one row of ``micro_batch_tokens`` (as verl's and OpenRLHF's
packing do), which leaves padding only at its end.

``pack`` lays a micro batch's sequences out that way: position ids restart at 0 for every
sequence, and the forward pass gets ``attention_mask=None``, from which Hugging Face
(``masking_utils.find_packed_sequence_indices``, transformers 5.x) derives a block-diagonal
causal mask for eager and SDPA attention (and ``cu_seqlens`` for flash-attention) — only when
``use_cache`` is False, else it builds a cache and attends across sequences; ``token_scores``
passes ``use_cache=False``, and ``tests/learner/test_packing.py`` checks the result against
each sequence alone. ``PackedRows.unpack`` moves per-token results back to the micro batch's
padded (b, l-1) layout, so the losses, their sequence-level aggregation and the normalisation
over the whole batch are exactly those of the padded computation. Which micro batch a sequence
lands in does not matter for the loss (its normalisers are the whole batch's), so groups may be
split across micro batches.

The step's other forwards run the same micro batches, packed alike: the KL reference's
(``asyncrl.learner.reference.micro_logprobs``) and the critic's (``CriticTrainer.values``).

Without ``micro_batch_tokens`` a micro batch is ``micro_batch_size`` sequences, one per row.
The step's ``padding_frac`` reports padded slots / computed slots either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatchPlan:
    """Rows ``lo:hi`` of the step's batch, and how their forward pass is laid out."""

    lo: int
    hi: int
    tokens: int
    """Real (prompt + response) tokens of its sequences."""
    capacity: int
    """Token slots its forward pass computes: rows x row length."""
    placement: list[tuple[int, int]] | None = None
    """Packed: (row, offset) of each sequence; None: one sequence per row, right-padded."""
    num_rows: int = 0
    row_tokens: int = 0


def plan_micro_batches(
    lengths: list[int], micro_batch_size: int, micro_batch_tokens: int | None, row_tokens: int | None = None
) -> list[MicroBatchPlan]:
    """The step's micro batches from its sequences' lengths (prompt + response tokens), in order.

    ``row_tokens``: the packed rows' length, raised to the longest sequence; None: the longest.
    """
    if micro_batch_tokens is None:
        plans = []
        for lo in range(0, len(lengths), micro_batch_size):
            hi = min(lo + micro_batch_size, len(lengths))
            longest = max(max(lengths[lo:hi]), 2)  # TrainBatch.slice keeps >= 2 columns
            plans.append(MicroBatchPlan(lo, hi, sum(lengths[lo:hi]), (hi - lo) * longest))
        return plans
    row_tokens = max(max(lengths), row_tokens or 0, 2)
    max_rows = max(1, micro_batch_tokens // row_tokens)
    plans: list[MicroBatchPlan] = []
    lo, free, placement = 0, [], []  # free: room left in each row of the open micro batch

    def close(hi: int) -> None:
        plans.append(
            MicroBatchPlan(lo, hi, sum(lengths[lo:hi]), len(free) * row_tokens, list(placement), len(free), row_tokens)
        )

    for index, length in enumerate(lengths):
        row = next((r for r, room in enumerate(free) if room >= length), None)
        if row is None and len(free) == max_rows:
            close(index)
            lo, free, placement = index, [], []
        if row is None:
            row = len(free)
            free.append(row_tokens)
        placement.append((row, row_tokens - free[row]))
        free[row] -= length
    close(len(lengths))
    return plans


@dataclass
class PackedRows:
    """A micro batch's sequences packed into rows: what the model's forward pass gets."""

    input_ids: torch.Tensor
    """(R, C) int64 the sequences back to back, ``pad_id`` after the last one of a row."""
    position_ids: torch.Tensor
    """(R, C) int64 0, 1, ... within each sequence (and within a row's trailing padding)."""
    score_mask: torch.Tensor
    """(R, C-1) float32 the micro batch's response mask, moved to the packed positions."""
    rows: torch.Tensor
    """(b,) int64 the row of each sequence."""
    offsets: torch.Tensor
    """(b,) int64 where each sequence starts in its row."""

    def unpack(self, packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(R, C-1) per-token values -> (b, l-1), the micro batch's padded layout, where ``mask``
        (the micro batch's response mask) is nonzero; 0 elsewhere. Differentiable."""
        seq, t = mask.nonzero(as_tuple=True)
        values = packed[self.rows[seq], self.offsets[seq] + t]
        return packed.new_zeros(mask.shape).index_put((seq, t), values)


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    plan: MicroBatchPlan,
    pad_id: int,
) -> PackedRows:
    """Pack the micro batch's right-padded rows (b, l) as ``plan.placement`` says."""
    if plan.placement is None:
        raise ValueError("plan has no placement: micro batches are packed only with micro_batch_tokens")
    R, C = plan.num_rows, plan.row_tokens
    ids = torch.full((R, C), pad_id, dtype=torch.int64, device=input_ids.device)
    positions = torch.arange(C, device=input_ids.device).repeat(R, 1)  # (R, C) trailing padding: its own run
    score = torch.zeros((R, C - 1), dtype=response_mask.dtype, device=response_mask.device)
    lengths = attention_mask.sum(dim=1).tolist()
    ends = [0] * R
    for seq, (row, offset) in enumerate(plan.placement):
        n = int(lengths[seq])
        ids[row, offset : offset + n] = input_ids[seq, :n]
        positions[row, offset : offset + n] = torch.arange(n, device=input_ids.device)
        score[row, offset : offset + n - 1] = response_mask[seq, : n - 1]
        ends[row] = max(ends[row], offset + n)
    for row, end in enumerate(ends):
        positions[row, end:] = torch.arange(C - end, device=input_ids.device)
    rows = torch.tensor([r for r, _ in plan.placement], dtype=torch.int64, device=input_ids.device)
    offsets = torch.tensor([o for _, o in plan.placement], dtype=torch.int64, device=input_ids.device)
    return PackedRows(ids, positions, score, rows, offsets)
