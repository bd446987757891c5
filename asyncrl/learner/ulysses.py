"""Sequence parallelism across learner ranks: DeepSpeed-Ulysses attention (Jacobs et al. 2023).

With ``learner.sequence_parallel: N`` the ranks form groups of N (``DataParallel.seq_group``)
that train the same rows. Every row of a micro batch (a padded sequence, or a packed row of
several: ``asyncrl.learner.packing``) is padded to a multiple of N positions and cut into N
contiguous shards; rank r of the group runs the model on shard r only, with the shard's global
position ids (RoPE sees the positions the whole row would). Everything but attention is
per position, so the embeddings, the MLPs, the norms and the LM head run on the shard alone;
activations per rank shrink by N. Attention needs the whole row, so around it (the paper's
Figure 2):

    q, k, v (b, heads, L/N, d) --all-to-all--> (b, heads/N, L, d)   each rank: all positions, 1/N of the heads
    attention over the whole row, per head (causal; block-diagonal for packed rows)
    out (b, heads/N, L, d)     --all-to-all--> (b, heads, L/N, d)   back to the shard, every head

Both exchanges are one ``all_to_all_single`` each per layer (q, k and v travel together), which
gloo carries on CPUs (checked here: torch 2.13) and NCCL on GPUs; their backward is the same
exchange of the gradients.

Heads. The query heads must divide by N. Key/value heads (GQA: Qwen2.5-0.5B has 14 query and 2
KV heads) are repeated, each ``f`` times in place (``repeat_interleave``), f the smallest factor
that makes ``kv_heads * f`` divisible by N, so that each rank's query heads find their own KV
heads among the ones it receives; that needs ``kv_heads * f`` to divide the query heads.
DeepSpeed's ``UlyssesSPAttentionHF`` allows only N | kv_heads or kv_heads | N; this rule is the
general one (``check_heads``). The repetition costs f times the KV traffic, never the queries'.

Scores and the loss. Each rank scores the tokens its own positions predict (the next token may
lie in the next shard: every rank holds the whole batch), then the group all-gathers the
(b, L-1) log-probabilities, entropies and outside-flags (``gather_shards``), so every rank of the
group computes the *same* micro batch loss, whatever its aggregation (sequence-level ratios,
GSPO and GMPO included). The gather's backward keeps only the rank's own slice of the gradient: the
loss's gradient with respect to each shard's scores enters once, on the rank that computed
them, and the parameter gradients of the group's ranks sum to the gradient of the whole rows'
loss (each rank backpropagates through its own positions' computations; the all-to-alls route
the attention's gradients between them). DeepSpeed averages the gradients over all ranks, so
the step scales the loss by the number of ranks, as for data parallelism
(``asyncrl.learner.data_parallel``).

Why not DeepSpeed's own ``UlyssesSPAttentionHF`` (``deepspeed.runtime.sequence_parallel``):
it replaces the ``sdpa`` attention of every model in the process, so the frozen reference, the
weight probe and LoRA's adapter-off reference would exchange shards too; with sdpa it drops the
attention mask and relies on ``is_causal``, which attends across the sequences of a packed row
(only its flash-attention path reads packed boundaries); and its groups come with an ``mpu``
that changes DeepSpeed's data-parallel group, which the step does not need. Here the attention
(registered as ``ATTENTION``) exchanges shards only inside ``active(...)``, which the trainer
enters for its own forward and backward passes; anywhere else it is plain sdpa.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from asyncrl.learner.logprobs import TokenDistribution, TokenScores, final_hidden_states, hidden_scores

ATTENTION = "asyncrl_ulysses_sdpa"
"""The attention implementation name the policy model is loaded with under sequence parallelism."""


def check_heads(heads: int, kv_heads: int, n: int) -> int:
    """The KV heads' repetition factor f for ``n`` ranks, or a ValueError naming the rule.

    >>> check_heads(14, 2, 2), check_heads(14, 2, 7), check_heads(16, 4, 8)
    (1, 7, 2)
    """
    if heads % n:
        raise ValueError(
            f"learner.sequence_parallel ({n}) must divide the model's attention heads ({heads}): each rank "
            "attends with heads / sequence_parallel of them"
        )
    f = n // math.gcd(kv_heads, n)
    if heads % (kv_heads * f):
        raise ValueError(
            f"the model's KV heads ({kv_heads}), repeated {f} times to divide by learner.sequence_parallel ({n}), "
            f"must divide its attention heads ({heads})"
        )
    return f


@dataclass
class _Active:
    group: object
    world: int
    kv_repeat: int
    mask: torch.Tensor | None
    """(b, 1, L, L) bool for packed rows (same sequence and causal); None: plain causal."""


_ACTIVE: list[_Active] = []  # the innermost active(...) scope; empty: attention is plain sdpa


@contextlib.contextmanager
def active(group, world: int, kv_repeat: int, positions: torch.Tensor) -> Iterator[None]:
    """Exchange shards in the attention within this block; ``positions``: (b, L) the whole
    rows' position ids (every rank of the group passes the same)."""
    _ACTIVE.append(_Active(group, world, kv_repeat, row_mask(positions)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def row_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """(b, 1, L, L) bool: query i sees key j when j <= i and both are in the same sequence (a new
    sequence starts where the position ids do not go up by 1, as Hugging Face reads packed rows);
    None when every row is one run, where causal alone is the mask."""
    start = torch.ones_like(positions[:, :1], dtype=torch.bool)
    segment = torch.cat([start, positions[:, 1:] != positions[:, :-1] + 1], dim=1).cumsum(dim=1)  # (b, L)
    if bool((segment[:, -1] == 1).all()):
        return None
    L = positions.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=positions.device).tril()
    return ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]  # (b, 1, L, L)


class _AllToAll(torch.autograd.Function):
    """(N, ...) -> (N, ...): block j goes to rank j, block j of the result came from rank j.
    The exchange is its own inverse, so the backward exchanges the gradient the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # the exchange reads and writes flat memory: empty_like must not keep a permutation
        out = torch.empty_like(x)
        torch.distributed.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        torch.distributed.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _heads_to_positions(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """(b, h, l, d) this shard, every head -> (b, h/n, n*l, d) every position, this rank's heads."""
    b, h, s, d = x.shape  # s: the shard's positions
    x = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # (n, b, h/n, s, d): block j for rank j
    x = _AllToAll.apply(x, group)  # block j: rank j's shard of this rank's heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _positions_to_heads(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """(b, h/n, n*l, d) -> (b, h, l, d): the inverse of ``_heads_to_positions``."""
    b, hn, L, d = x.shape
    x = x.reshape(b, hn, n, L // n, d).permute(2, 0, 1, 3, 4)  # (n, b, h/n, l, d): shard j for rank j
    x = _AllToAll.apply(x, group)  # block j: rank j's heads of this rank's shard
    return x.transpose(0, 1).reshape(b, n * hn, L // n, d)


def ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A Hugging Face attention function (``AttentionInterface``): plain sdpa outside ``active``;
    inside, the Ulysses exchange around sdpa (module docstring). query (b, h, l, d), key and value
    (b, kv, l, d) of this rank's shard; returns (b, l, h, d) as Hugging Face's sdpa does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _ACTIVE:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    state = _ACTIVE[-1]
    if kwargs.get("sliding_window") is not None:
        raise ValueError("learner.sequence_parallel does not support sliding-window attention layers")
    n, group = state.world, state.group
    b, h, s, d = query.shape  # s: the shard's positions
    if state.kv_repeat > 1:
        key = key.repeat_interleave(state.kv_repeat, dim=1)
        value = value.repeat_interleave(state.kv_repeat, dim=1)
    kv = key.shape[1]
    # One exchange for q, k and v: each rank's block holds its query heads, then its key and value heads.
    qkv = torch.cat(
        [query.reshape(b, n, h // n, s, d), key.reshape(b, n, kv // n, s, d), value.reshape(b, n, kv // n, s, d)],
        dim=2,
    ).reshape(b, h + 2 * kv, s, d)
    qkv = _heads_to_positions(qkv, n, group)  # (b, (h + 2 kv)/n, L, d)
    q, k, v = qkv.split([h // n, kv // n, kv // n], dim=1)
    if h != kv:  # each rank's query heads share its KV heads in groups of h / kv, as repeat_kv lays them out
        k = k.repeat_interleave(h // kv, dim=1)
        v = v.repeat_interleave(h // kv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=state.mask,
        dropout_p=dropout if module.training else 0.0,
        is_causal=state.mask is None,
        scale=scaling,
    )  # (b, h/n, L, d)
    out = _positions_to_heads(out, n, group)  # (b, h, l, d)
    return out.transpose(1, 2).contiguous(), None


def _mask_function(*args, **kwargs):
    """Hugging Face's sdpa mask outside ``active``; inside, none (the attention builds the whole
    rows' mask itself: a mask of the shard alone would be the wrong one)."""
    from transformers.masking_utils import sdpa_mask

    return None if _ACTIVE else sdpa_mask(*args, **kwargs)


def register_attention() -> str:
    """Register ``ATTENTION`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, _mask_function)
    return ATTENTION


class _GatherShards(torch.autograd.Function):
    """(..., l) this rank's shard -> (..., n*l) every rank's, in rank order. The backward keeps
    only this rank's slice: every rank computes the same loss from the gathered tensor, so the
    gradient of each shard enters once, where it was computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, n: int, rank: int) -> torch.Tensor:
        ctx.rank, ctx.l = rank, x.shape[-1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        torch.distributed.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.rank * ctx.l : (ctx.rank + 1) * ctx.l], None, None, None


def gather_shards(x: torch.Tensor, group, n: int, rank: int) -> torch.Tensor:
    """``_GatherShards``: the group's shards of ``x`` along its last dimension."""
    return _GatherShards.apply(x, group, n, rank)


@dataclass
class SequenceParallel:
    """A sequence-parallel group as the trainer uses it: which shard is this rank's, and how."""

    group: object
    """The group's process group (``DataParallel.seq_group``)."""
    world: int
    """Ranks in the group, N."""
    rank: int
    """This rank's shard."""
    kv_repeat: int
    """The KV heads' repetition factor (``check_heads``)."""
    pad_id: int
    """The token id that pads a row to a multiple of N positions."""
    _positions: torch.Tensor | None = None

    def scope(self, positions: torch.Tensor):
        """``active(...)`` for rows of these (b, L) whole position ids."""
        self._positions = positions
        return active(self.group, self.world, self.kv_repeat, positions)

    def backward_scope(self):
        """``active(...)`` again for the last forward's rows, around its backward: gradient
        checkpointing recomputes the attention there, which must exchange shards as it did."""
        if self._positions is None:
            return contextlib.nullcontext()
        return active(self.group, self.world, self.kv_repeat, self._positions)

    def token_scores(
        self,
        model,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        score_mask: torch.Tensor,
        dist: TokenDistribution,
        chunk_tokens: int,
        entropy: bool,
        entropy_grad: bool,
    ) -> TokenScores:
        """``logprobs.token_scores`` of whole (b, L) rows with their (b, L) position ids (no
        attention mask: right padding and packed rows are told apart by the positions), this rank
        running its shard; the same (b, L-1) scores on every rank of the group."""
        n = self.world
        b, L = input_ids.shape
        pad = (-L) % n
        if pad:  # trailing slots: after every real token, so causal attention keeps them out of its view
            input_ids = torch.cat([input_ids, input_ids.new_full((b, pad), self.pad_id)], dim=1)
            tail = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
            position_ids = torch.cat([position_ids, tail], dim=1)
        full = L + pad
        shard = full // n
        lo, hi = self.rank * shard, (self.rank + 1) * shard
        targets = torch.cat([input_ids[:, 1:], input_ids.new_full((b, 1), self.pad_id)], dim=1)  # (b, full)
        mask = torch.cat([score_mask, score_mask.new_zeros(b, full - (L - 1))], dim=1)  # (b, full)
        with self.scope(position_ids):
            hidden = final_hidden_states(model, input_ids[:, lo:hi], None, position_ids[:, lo:hi])  # (b, shard, H)
        counts = mask.reshape(b, n, shard).count_nonzero(dim=(0, 2))  # (n,) scored positions per shard
        chunks = int((counts + chunk_tokens - 1).div(chunk_tokens, rounding_mode="floor").max())
        own = hidden_scores(
            model, hidden, targets[:, lo:hi], mask[:, lo:hi], dist, chunk_tokens, entropy, entropy_grad, chunks
        )  # (b, shard) each
        stacked = gather_shards(torch.stack(list(own)), self.group, n, self.rank)  # (3, b, full)
        return TokenScores(*(x[:, : L - 1] for x in stacked.unbind(0)))
