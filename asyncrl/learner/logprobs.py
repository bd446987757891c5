"""Per-token log-probabilities and entropy of a causal LM, in memory bounded per token.

A causal LM's logits are (B, L, V): at a real vocabulary (V = 151,936 for Qwen2.5) and a training
batch of 8 x 2,048 tokens that is 10 GB in float32, plus as much again for the softmax and its
gradient, while the model itself may be 1 GB. None of it is needed at once. ``token_scores``
therefore

1. runs the model to its final hidden states (B, L, H) — through the model's own ``__call__``,
   so a DeepSpeed engine's hooks (the backward prologue, ZeRO-3's parameter gathering) run as
   for any forward;
2. keeps only the positions whose next token is scored (the response tokens: a prompt position's
   logits are never used), N of them, (N, H);
3. applies the LM head to chunks of ``chunk_tokens`` of those positions, each chunk's logits in
   the model's dtype, softmax statistics in float32, and keeps per token only the target's
   log-probability and the entropy;
4. under autograd, wraps each chunk in ``torch.utils.checkpoint``: the backward recomputes the
   chunk's logits from its (n, H) hidden states instead of holding them.

So the extra memory is one chunk's logits, (chunk_tokens, V), forward and backward, whatever B
and L. The LM head is called as a module (``model.get_output_embeddings()``), never through its
``.weight``, so ZeRO-3 gathers the partitioned weight for each call and tied embeddings are the
same module call. verl and OpenRLHF instead compute the full logits and chunk only the
log-softmax (or use a fused Triton kernel); this keeps the logits of the scored tokens only.

The scored distribution (``TokenDistribution``) is the one the generators sample from with
vLLM's ``logprobs_mode="processed_logprobs"`` (``asyncrl.generators.engines.vllm_engine``): z = logits / T in
float32, then the top-k filter and then the top-p nucleus, both on the tempered z, exactly as
vLLM's PyTorch sampler path (``apply_top_k_top_p_pytorch``; ``apply_top_k_only`` when top-p is
off) computes them:

- top-k keeps every token whose z is >= the k-th largest z: ties with the k-th value are all
  kept (so possibly more than k tokens);
- top-p sorts the kept z ascending (``torch.sort``, not stable), takes the float32 cumulative sum
  of their softmax, and drops a token when that sum, up to and including it, is <= 1 - p (the
  most likely token is always kept). So a token is kept when the mass of the tokens sorted above
  it is < p; among tokens tied in z at the boundary, the sort order decides which are kept, as
  in vLLM; and a token within float rounding of the boundary may fall on different sides for the
  learner and the sampler, whose logits differ by the same rounding.

log pi(y) = z_y - logsumexp_{v in kept} z_v, and the entropy is that of the renormalised kept
distribution. A sampled token y that is *not* in the learner's kept set (its weights moved since
sampling, or a rounding flip at the boundary) would have log-probability -inf, which turns every
ratio against it into 0 or NaN; instead it is scored over kept ∪ {y} (finite, with a gradient),
and counted in ``TokenScores.outside``. Without top-k/top-p the kept set is the vocabulary and
this is the plain ``log_softmax(logits / T)[y]`` of ``asyncrl.learner.batch.token_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class TokenDistribution:
    """The sampling distribution of the generators, which the learner scores tokens under."""

    temperature: float = 1.0
    """Logits are divided by it (float32) before anything else."""
    top_k: int = 0
    """Keep the tokens whose tempered logit is >= the k-th largest; 0: off."""
    top_p: float = 1.0
    """Keep the nucleus of this mass of the (top-k filtered) tempered distribution; 1: off."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"temperature ({self.temperature}) must be > 0: the learner scores the sampling distribution"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k ({self.top_k}) must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]")

    @property
    def truncated(self) -> bool:
        """Whether top-k or top-p removes tokens from the support."""
        return self.top_k > 0 or self.top_p < 1.0


class TokenScores(NamedTuple):
    """Per predicting position t (about ``input_ids[:, t + 1]``), 0 where not scored."""

    logprobs: torch.Tensor
    """(B, L-1) float32 log pi(input_ids[:, t+1]) under the ``TokenDistribution``."""
    entropy: torch.Tensor
    """(B, L-1) float32 entropy of that distribution at t (zeros when not asked for)."""
    outside: torch.Tensor
    """(B, L-1) float32, 1 where the target token lies outside the top-k/top-p set (see the module docstring)."""


def final_hidden_states(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The causal LM's last hidden states (B, L, H), after the final norm, without its logits.

    The model is called whole (a DeepSpeed engine or a Hugging Face ``...ForCausalLM``) with an
    empty ``logits_to_keep``, so the LM head runs on no position, and ``output_hidden_states``;
    Hugging Face ties the last entry to the normed ``last_hidden_state``. Going through the
    model's own call matters under DeepSpeed: the engine hangs its backward prologue (ZeRO's
    accumulation boundary) on the forward's outputs, of which these hidden states are one.
    Without gradient, the returned tuple holds every layer's (B, L, H) until this returns.
    """
    kwargs = {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=False,
        logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
        output_hidden_states=True,
        **kwargs,
    )
    return out.hidden_states[-1]


def _unwrap(model) -> torch.nn.Module:
    return getattr(model, "module", model)  # a DeepSpeed engine holds the HF model as .module


def token_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    score_mask: torch.Tensor,
    dist: TokenDistribution = TokenDistribution(),
    *,
    position_ids: torch.Tensor | None = None,
    chunk_tokens: int = 512,
    entropy: bool = True,
    entropy_grad: bool = True,
) -> TokenScores:
    """Log-probabilities (and entropy) of the next tokens at the positions ``score_mask`` marks.

    Args:
        model: a causal LM (Hugging Face ``...ForCausalLM`` or a DeepSpeed engine around one).
        input_ids: (B, L) token ids; ``attention_mask``: (B, L) or None (every token real).
        score_mask: (B, L-1), nonzero at position t when ``input_ids[:, t+1]`` is to be scored.
        dist: the sampling distribution (temperature, top-k, top-p).
        position_ids: (B, L) positions, for packed rows where they restart per sequence.
        chunk_tokens: scored positions per LM-head call: the memory bound, (chunk_tokens, V).
        entropy: also compute the entropy (else zeros).
        entropy_grad: give the entropy a gradient (it is in the loss). Without, it is computed
            outside autograd: a chunk's recomputation in the backward would otherwise rebuild
            the entropy's (chunk, V) intermediates and, as nothing backpropagates through them,
            keep them until the step's graph is freed.

    Differentiable in ``logprobs`` (and ``entropy``); the chunks' logits are recomputed in the
    backward (see the module docstring).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens ({chunk_tokens}) must be >= 1")
    B, L = input_ids.shape
    if score_mask.shape != (B, L - 1):
        raise ValueError(f"score_mask shape {tuple(score_mask.shape)} must be (B, L-1) = {(B, L - 1)}")
    hidden = final_hidden_states(model, input_ids, attention_mask, position_ids)  # (B, L, H)
    return hidden_scores(model, hidden, input_ids[:, 1:], score_mask, dist, chunk_tokens, entropy, entropy_grad)


def hidden_scores(
    model,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    score_mask: torch.Tensor,
    dist: TokenDistribution,
    chunk_tokens: int,
    entropy: bool,
    entropy_grad: bool,
    chunks: int = 0,
) -> TokenScores:
    """``token_scores`` from the final hidden states on: (B, T, H) ``hidden``, (B, T') ``targets``
    (the token each position predicts) and ``score_mask``, T' <= T. Each returned tensor is
    (B, T'). A sequence-parallel rank calls it on its own positions (``asyncrl.learner.ulysses``),
    with ``chunks``: call the LM head at least that many times, the last ones on no position, so
    that every rank of the group calls it equally often (ZeRO-3 gathers a partitioned head for
    each call, a collective). Under ZeRO-3 the ranks also agree on the count across data-parallel
    ranks, whose micro batches score different numbers of positions (``_head_calls_agreed``)."""
    B, T = score_mask.shape
    rows, cols = score_mask.nonzero(as_tuple=True)  # (N,), (N,)
    h = hidden[rows, cols]  # (N, H) the predicting positions
    targets = targets[rows, cols]  # (N,)
    lm_head = _unwrap(model).get_output_embeddings()
    head = _frozen_partitioned_head(lm_head) or lm_head
    if head is lm_head:
        chunks = _head_calls_agreed(lm_head, max(chunks, -(-h.shape[0] // chunk_tokens)), h.device)
    grad = torch.is_grad_enabled() and h.requires_grad
    parts = []
    starts = list(range(0, h.shape[0], chunk_tokens))
    starts += [h.shape[0]] * (chunks - len(starts))  # empty chunks: h[N:N]
    for start in starts:
        args = (head, h[start : start + chunk_tokens], targets[start : start + chunk_tokens], dist, entropy)
        if grad:
            parts.append(checkpoint(_score_chunk, *args, entropy_grad, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_score_chunk(*args, False))
    out = []
    for index in range(3):
        # No scored position (every answer of the micro batch out of the loss): an empty slice of
        # h keeps the outputs in the graph, so the backward still runs (ZeRO's hooks, the
        # accumulation boundary) and gives zero gradients.
        flat = torch.cat([p[index] for p in parts]) if parts else h.sum(dim=-1).float()  # (N,)
        out.append(hidden.new_zeros(B, T, dtype=torch.float32).index_put((rows, cols), flat))  # (B, T)
    return TokenScores(*out)


def _score_chunk(
    lm_head: torch.nn.Module | tuple[torch.Tensor, torch.Tensor | None],
    h: torch.Tensor,
    targets: torch.Tensor,
    dist: TokenDistribution,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, H) hidden states, (n,) targets -> (n,) logprob, entropy, outside (float32 each)."""
    if isinstance(lm_head, tuple):  # a frozen head's gathered (weight, bias)
        z = torch.nn.functional.linear(h, *lm_head).float()  # (n, V)
    else:
        z = lm_head(h).float()  # (n, V) model dtype from the head, float32 from here
    if dist.temperature != 1.0:
        z = z / dist.temperature
    z_target = z.gather(-1, targets[:, None]).squeeze(-1)  # (n,)
    kept = truncation_mask(z.detach(), dist) if dist.truncated else None  # (n, V) bool or None
    if kept is None:
        lse = torch.logsumexp(z, dim=-1)  # (n,)
        logprob = z_target - lse
        outside = torch.zeros_like(logprob)
    else:
        lse = torch.logsumexp(z.masked_fill(~kept, float("-inf")), dim=-1)  # (n,) over the kept set
        target_kept = kept.gather(-1, targets[:, None]).squeeze(-1)  # (n,)
        # A target outside the kept set is scored over kept ∪ {target} (module docstring).
        logprob = z_target - torch.where(target_kept, lse, torch.logaddexp(lse, z_target))
        outside = (~target_kept).float()
    if not with_entropy:
        return logprob, torch.zeros_like(logprob), outside
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        if kept is None:  # H = logsumexp(z) - sum_v softmax(z)_v z_v
            ent = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        else:
            logp = (z - lse[:, None]).masked_fill(~kept, 0.0)  # (n, V) finite everywhere
            ent = -(logp.exp() * kept * logp).sum(dim=-1)  # H of the renormalised kept set
    return logprob, ent, outside


def truncation_mask(z: torch.Tensor, dist: TokenDistribution) -> torch.Tensor:
    """(n, V) tempered float32 logits -> (n, V) bool, True for the tokens top-k then top-p keep.

    The same operations as vLLM's PyTorch sampler (see the module docstring), so that equal
    logits give an equal kept set, ties included.
    """
    vocab = z.shape[-1]
    k = min(dist.top_k, vocab)
    if dist.top_p >= 1.0:  # vLLM's apply_top_k_only: no sort of the vocabulary
        kth = z.topk(k, dim=-1).values[:, -1:]  # (n, 1) the k-th largest value
        return z >= kth
    z_sort, index = z.sort(dim=-1, descending=False)  # (n, V) ascending
    if k > 0:
        kth = z_sort[:, vocab - k : vocab - k + 1]  # (n, 1)
        z_sort = z_sort.masked_fill(z_sort < kth, float("-inf"))
    cumulative = z_sort.softmax(dim=-1).cumsum(dim=-1)  # (n, V) mass up to and including each
    # 1 - p in float32, as vLLM computes it from its float32 top_p tensor.
    threshold = 1 - torch.tensor(dist.top_p, dtype=torch.float32, device=z.device)
    drop = cumulative <= threshold
    drop[:, -1] = False  # at least one token
    drop |= torch.isinf(z_sort)  # what top-k removed
    return torch.empty_like(drop).scatter_(-1, index, ~drop)


def _head_calls_agreed(lm_head: torch.nn.Module, calls: int, device: torch.device) -> int:
    """The most LM-head calls any rank needs, where ZeRO-3 gathers a partitioned head for each
    call (a collective over the ranks that partition it): every rank must call it as often,
    however many positions it scores, or the ranks' gathers pair up wrongly and the group fails.
    ``calls`` elsewhere (no ZeRO-3, one rank, a head small enough that DeepSpeed keeps it whole:
    ``stage3_param_persistence_threshold``). ``device``: the activations' (a partitioned
    parameter may sit on the host, which NCCL cannot reduce)."""
    weight = lm_head.weight
    group = getattr(weight, "ds_process_group", None)
    if not hasattr(weight, "ds_id") or getattr(weight, "ds_persist", False):
        return calls
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return calls
    most = torch.tensor([calls], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(most.item())


def _frozen_partitioned_head(lm_head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A frozen head that ZeRO-3 partitions (LoRA's base), as a gathered copy of (weight, bias);
    None for any other head, which is called as a module.

    DeepSpeed 0.19 gathers a module's parameters for each call in the forward pass, but hands the
    backward's recomputation of a checkpointed chunk a frozen weight's empty partition (torch's
    CheckpointError: shape [0]). The copy, taken once per call of ``token_scores`` and kept until
    the step's backward has run, is what every chunk's forward and recomputation multiply by: one
    head's worth of memory (V x H) more, and no gradient, as the weight is frozen.
    """
    weight = lm_head.weight
    if not hasattr(weight, "ds_id") or weight.requires_grad:
        return None
    import deepspeed

    params = [p for p in (weight, lm_head.bias) if p is not None]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        bias = None if lm_head.bias is None else lm_head.bias.detach().clone()
        return weight.detach().clone(), bias
