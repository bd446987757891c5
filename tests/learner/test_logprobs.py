"""token_scores: the chunked, response-only log-probabilities and entropy equal the full-logits
computation (values and gradients), hold at most one chunk of logits, and apply vLLM's top-k /
top-p exactly."""

import math

import pytest
import torch
from transformers import Qwen2ForCausalLM  # noqa: F401  imported at collection, not charged to the first test (~4 s)

from asyncrl.learner.batch import token_logprobs
from asyncrl.learner.logprobs import TokenDistribution, token_scores, truncation_mask
from tests.factories import small_qwen2

torch.set_num_threads(1)
VOCAB = 48


def make_model(tied: bool, dtype=torch.float32):
    return small_qwen2(VOCAB, tied=tied).to(dtype)


def make_batch(seed=0):
    """3 right-padded rows; the scored positions are each row's response (prompt lengths 3, 2, 4)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (3, 11), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    attention_mask[2, 9:] = 0
    input_ids[attention_mask == 0] = 0
    score_mask = torch.zeros(3, 10)
    score_mask[0, 2:10] = 1
    score_mask[1, 1:6] = 1
    score_mask[2, 3:8] = 1
    return input_ids, attention_mask, score_mask


def full_logits_scores(model, input_ids, attention_mask, score_mask, temperature):
    """The old path: (B, L, V) float32 logits, log-softmax and entropy over all of them."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, L, V)
    logprobs = token_logprobs(logits, input_ids, temperature) * score_mask
    z = logits[:, :-1].float() / temperature
    entropy = (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)) * score_mask
    return logprobs, entropy


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 1024])
def test_chunked_scores_equal_the_full_logits_in_fp32(tied, chunk_tokens):
    model = make_model(tied)
    input_ids, attention_mask, score_mask = make_batch()
    weights = torch.randn(3, 10)  # an arbitrary loss, so every position's gradient counts

    lp_full, ent_full = full_logits_scores(model, input_ids, attention_mask, score_mask, 0.7)
    ((lp_full * weights).sum() + (ent_full * weights).sum()).backward()
    expected = grads(model)
    model.zero_grad()

    dist = TokenDistribution(temperature=0.7)
    scores = token_scores(model, input_ids, attention_mask, score_mask, dist, chunk_tokens=chunk_tokens)
    ((scores.logprobs * weights).sum() + (scores.entropy * weights).sum()).backward()
    got = grads(model)

    torch.testing.assert_close(scores.logprobs, lp_full, rtol=0, atol=1e-5)
    torch.testing.assert_close(scores.entropy, ent_full, rtol=0, atol=1e-5)
    assert scores.logprobs.dtype == torch.float32 and scores.outside.sum() == 0
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    # Unscored positions (prompt, padding) are 0
    assert (scores.logprobs[score_mask == 0] == 0).all() and (scores.entropy[score_mask == 0] == 0).all()


def test_chunked_scores_in_bf16_are_within_bf16_tolerance_of_fp32():
    model32 = make_model(tied=False)
    model16 = make_model(tied=False, dtype=torch.bfloat16)
    input_ids, attention_mask, score_mask = make_batch()
    dist = TokenDistribution(temperature=1.0)
    lp32, ent32 = full_logits_scores(model32, input_ids, attention_mask, score_mask, 1.0)
    lp32.sum().backward()
    scores = token_scores(model16, input_ids, attention_mask, score_mask, dist, chunk_tokens=4)
    scores.logprobs.sum().backward()
    assert scores.logprobs.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: logits of size ~4 carry ~0.02 of rounding per layer
    torch.testing.assert_close(scores.logprobs, lp32, rtol=0, atol=0.1)
    torch.testing.assert_close(scores.entropy, ent32, rtol=0, atol=0.1)
    for name, p32 in model32.named_parameters():
        g16 = dict(model16.named_parameters())[name].grad.float()
        cos = torch.nn.functional.cosine_similarity(g16.flatten(), p32.grad.flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))


def test_no_call_of_the_lm_head_sees_more_than_one_chunk_forward_or_backward():
    model = make_model(tied=False)
    input_ids, attention_mask, score_mask = make_batch()
    rows_per_call = []
    model.lm_head.register_forward_hook(lambda mod, args, out: rows_per_call.append(out.shape[:-1].numel()))
    scores = token_scores(model, input_ids, attention_mask, score_mask, chunk_tokens=4)
    forward_calls = len(rows_per_call)
    scores.logprobs.sum().backward()
    scored = int(score_mask.sum())  # 18 response positions of 33 (B * (L-1) = 30 without padding)
    # 1 empty call (logits_to_keep) + ceil(18 / 4) chunks forward, the same chunks recomputed backward
    assert forward_calls == 1 + math.ceil(scored / 4)
    assert len(rows_per_call) == 1 + 2 * math.ceil(scored / 4)
    assert max(rows_per_call) == 4 and rows_per_call[0] == 0


def vllm_apply_top_k_top_p():
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch


@pytest.mark.parametrize(
    "top_k,top_p", [(5, 1.0), (0, 0.7), (0, 0.05), (7, 0.8), (1, 1.0), (0, 0.999), (VOCAB + 3, 0.9)]
)
def test_truncation_mask_is_vllms(top_k, top_p):
    """Same kept set as vLLM's own top-k/top-p code on the same float32 tempered logits, ties
    included (rows with repeated values)."""
    apply = vllm_apply_top_k_top_p()
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(64, VOCAB, generator=gen) * 2
    z[::3] = torch.round(z[::3])  # many exact ties, at the boundary too
    ours = truncation_mask(z, TokenDistribution(top_k=top_k, top_p=top_p))
    k = torch.full((64,), min(top_k, VOCAB), dtype=torch.long) if top_k else None
    p = torch.full((64,), top_p, dtype=torch.float32) if top_p < 1 else None
    theirs = torch.isfinite(apply(z.clone(), k, p, allow_cpu_sync=True))
    assert torch.equal(ours, theirs)
    if top_k:
        # ties with the k-th value are kept, so at least k tokens survive the top-k filter
        assert (ours.sum(-1) >= min(top_k, VOCAB) if top_p == 1 else ours.sum(-1) >= 1).all()


def test_truncated_logprobs_are_the_renormalised_kept_distribution():
    model = make_model(tied=True)
    input_ids, attention_mask, score_mask = make_batch()
    dist = TokenDistribution(temperature=0.8, top_k=6, top_p=0.9)
    scores = token_scores(model, input_ids, attention_mask, score_mask, dist, chunk_tokens=3)
    with torch.no_grad():
        z = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / 0.8  # (B, L-1, V)
        kept = truncation_mask(z.reshape(-1, VOCAB), dist).reshape(z.shape)
        logp = torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1)  # -inf off the kept set
        target = input_ids[:, 1:]
        expected = logp.gather(-1, target[..., None]).squeeze(-1)
        inside = kept.gather(-1, target[..., None]).squeeze(-1) & (score_mask > 0)
        p = logp.exp()
        entropy = -(p * logp.masked_fill(~kept, 0)).sum(-1)
    assert inside.any() and (~inside & (score_mask > 0)).any()  # both cases occur with random tokens
    torch.testing.assert_close(scores.logprobs[inside], expected[inside], rtol=0, atol=1e-5)
    torch.testing.assert_close(scores.entropy[score_mask > 0], entropy[score_mask > 0], rtol=0, atol=1e-5)
    assert torch.equal(scores.outside > 0, ~inside & (score_mask > 0))
    # a token outside the kept set is scored over kept ∪ {token}: finite, below every kept token's floor
    outside = scores.logprobs[scores.outside > 0]
    assert torch.isfinite(outside).all() and (outside < 0).all()
    with torch.no_grad():
        z_t = z.gather(-1, target[..., None]).squeeze(-1)
        lse_kept = torch.logsumexp(z.masked_fill(~kept, float("-inf")), -1)
        extended = z_t - torch.logaddexp(lse_kept, z_t)
    torch.testing.assert_close(scores.logprobs[scores.outside > 0], extended[scores.outside > 0], rtol=0, atol=1e-5)
    # gradients are finite everywhere
    (scores.logprobs.sum() + scores.entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_distribution_rejects_bad_values():
    with pytest.raises(ValueError, match=r"temperature \(0.0\) must be > 0"):
        TokenDistribution(temperature=0.0)
    with pytest.raises(ValueError, match=r"top_k \(-1\) must be >= 0"):
        TokenDistribution(top_k=-1)
    with pytest.raises(ValueError, match=r"top_p \(0.0\) must be in \(0, 1\]"):
        TokenDistribution(top_p=0.0)
    with pytest.raises(ValueError, match=r"chunk_tokens \(0\) must be >= 1"):
        token_scores(make_model(False), *make_batch(), chunk_tokens=0)


@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_after_the_backward_no_chunk_of_logits_is_alive(entropy_in_loss):
    """Nothing of shape (n, V) outlives the backward while the scores are still held (as the
    trainer holds them until its stats are summed): a chunk's recomputed logits and softmax are
    freed as soon as its backward has used them, the entropy's too when it is not in the loss."""
    import gc

    model = make_model(tied=False)
    input_ids, attention_mask, score_mask = make_batch()
    gc.collect()
    before = {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor)}
    scores = token_scores(
        model, input_ids, attention_mask, score_mask, chunk_tokens=4, entropy=True, entropy_grad=entropy_in_loss
    )
    loss = scores.logprobs.sum() + (scores.entropy.sum() if entropy_in_loss else 0.0)
    loss.backward()
    gc.collect()
    alive = [
        tuple(t.shape)
        for t in gc.get_objects()
        if isinstance(t, torch.Tensor) and id(t) not in before and t.dim() == 2 and t.shape[-1] == VOCAB
    ]
    assert alive == [] and scores.entropy.sum() > 0
