"""A batch of examples cut into micro batches, laid out (padded or packed) and scored.

A micro batch holds whole examples, so a DPO pair's two responses are scored in one forward
pass and its loss has both: at most ``micro_batch_size`` sequences, or, with
``micro_batch_tokens`` set, at most that many real tokens (always at least one example). With
``micro_batch_tokens`` the sequences are packed several to a row by ``asyncrl.learner.packing``
(position ids restarting per sequence, a block-diagonal causal mask): the same per-token
log-probabilities as the padded layout, on fewer computed slots, which
``tests/learner/offline/test_micro.py`` checks.

``score_micro`` returns, for each example and each of its sequences, the (T,) log-probabilities
of the tokens its mask marks (position t scores token t + 1, so a token is learned where
``mask[t + 1]`` is 1), with gradient when called with one.
"""

from __future__ import annotations

import torch

from asyncrl.learner.logprobs import token_scores
from asyncrl.learner.offline.data import Example
from asyncrl.learner.packing import pack, plan_micro_batches


def cut_micro_batches(
    examples: list[Example], micro_batch_size: int, micro_batch_tokens: int | None
) -> list[list[Example]]:
    """Runs of whole examples, in order, within the micro batch's budget (see the module)."""
    micros: list[list[Example]] = []
    current: list[Example] = []
    used = 0
    for example in examples:
        cost = example.tokens if micro_batch_tokens is not None else len(example.sequences)
        budget = micro_batch_tokens if micro_batch_tokens is not None else micro_batch_size
        if current and used + cost > budget:
            micros.append(current)
            current, used = [], 0
        current.append(example)
        used += cost
    if current:
        micros.append(current)
    return micros


def padded(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence of ``examples`` right-padded: (input_ids, attention_mask) (S, L) and the
    score mask (S, L-1), 1 at position t when token t + 1 is learned."""
    seqs = [s for e in examples for s in e.sequences]
    length = max(2, max(len(s.ids) for s in seqs))
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), length), dtype=torch.long)
    score = torch.zeros((len(seqs), length - 1), dtype=torch.float32)
    for row, seq in enumerate(seqs):
        n = len(seq.ids)
        ids[row, :n] = torch.tensor(seq.ids, dtype=torch.long)
        attention[row, :n] = 1
        score[row, : n - 1] = torch.tensor(seq.mask[1:], dtype=torch.float32)
    return ids, attention, score


def score_micro(
    model, examples: list[Example], pad_id: int, packed: bool, chunk_tokens: int = 512
) -> list[list[torch.Tensor]]:
    """The policy's log-probabilities of each example's learned tokens, ``[example][sequence]``: (T,)."""
    ids, attention, score = padded(examples, pad_id)
    device = getattr(model, "device", None) or next(model.parameters()).device
    if packed:
        lengths = attention.sum(dim=1).tolist()
        # One plan for the whole micro batch: a budget every sequence fits in, rows as long as the longest.
        (plan,) = plan_micro_batches(lengths, len(lengths), len(lengths) * max(2, max(lengths)))
        rows = pack(ids, attention, score, plan, pad_id)
        out = token_scores(
            model,
            rows.input_ids.to(device),
            None,
            rows.score_mask.to(device),
            position_ids=rows.position_ids.to(device),
            chunk_tokens=chunk_tokens,
            entropy=False,
        ).logprobs  # (R, C-1)
        logprobs = rows.unpack(out, score.to(device))  # (S, L-1)
    else:
        logprobs = token_scores(
            model, ids.to(device), attention.to(device), score.to(device), chunk_tokens=chunk_tokens, entropy=False
        ).logprobs  # (S, L-1)
    mask = score.to(device) > 0
    result, row = [], 0
    for example in examples:
        result.append([logprobs[row + j][mask[row + j]] for j in range(len(example.sequences))])
        row += len(example.sequences)
    return result
