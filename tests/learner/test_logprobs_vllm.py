"""Sampling consistency against the real vLLM (CPU build) engine: under top-k and top-p the
behaviour logprobs vLLM reports (``processed_logprobs``: the truncated, renormalised
distribution) equal the learner's recomputation of the same sampled tokens, through the learner's
own batch layout; without the truncation the learner would be off by the nucleus's log-mass.

Every other sampling option training allows (``asyncrl.generators.sampling``) is checked the same
way: stop strings and stop token ids (the tokens end at the stop, every one trained, the text cut)
and per-group seeds; ``min_tokens``, which training refuses, is shown to change vLLM's logprobs by
exactly the stop tokens' mass that the learner does not take out."""

from __future__ import annotations

import os

# vLLM reads these at import time.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: fast start

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it)

from asyncrl.generators.engines.vllm_engine import SamplingConfig  # noqa: E402
from asyncrl.learner.batch import collate  # noqa: E402
from asyncrl.learner.logprobs import TokenDistribution, token_scores  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from asyncrl.wire.schema import Group, Sample  # noqa: E402
from tests.factories import vllm_engine  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine

PROMPTS = ["1+2=", "34+5=", "hello", "7*8=", "a"]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(seed=0), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    with vllm_engine(tmp_path_factory, model_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _batch(completions):
    """The learner's batch of the engine's completions (one group per prompt)."""
    groups = [
        Group(
            f"g{g}",
            f"p{g}",
            "t",
            "",
            "",
            group[0].prompt_ids,
            0,
            "gen",
            [
                Sample(f"g{g}/{i}", c.response_ids, c.logprobs, c.text, c.finish_reason, 0.0)
                for i, c in enumerate(group)
            ],
        )
        for g, group in enumerate(completions)
    ]
    return collate(groups, [np.zeros(len(g.samples), np.float32) for g in groups], pad_id=0)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7), (8, 0.8)])
def test_learner_logprobs_equal_vllms_under_top_k_and_top_p(engine, hf_model, top_k, top_p):
    sampling = SamplingConfig(n=4, max_tokens=8, temperature=TEMPERATURE, top_k=top_k, top_p=top_p)
    completions = engine.generate(PROMPTS, sampling, seed=1)
    batch = _batch(completions)
    mask = batch.response_mask > 0
    assert mask.sum() >= 50  # enough sampled tokens to mean something

    dist = TokenDistribution(TEMPERATURE, top_k, top_p)
    with torch.no_grad():
        truncated = token_scores(hf_model, batch.input_ids, batch.attention_mask, batch.response_mask, dist)
        full = token_scores(
            hf_model, batch.input_ids, batch.attention_mask, batch.response_mask, TokenDistribution(TEMPERATURE)
        )
    behaviour = batch.behaviour_logprobs[mask]
    assert truncated.outside[mask].sum() == 0  # every sampled token is in the learner's kept set
    np.testing.assert_allclose(truncated.logprobs[mask].numpy(), behaviour.numpy(), rtol=0, atol=1e-4)
    # not vacuous: the untruncated distribution is measurably different (by log of the kept mass)
    gap = (behaviour - full.logprobs[mask]).mean().item()
    assert gap > 0.05, gap
    # the learner's entropy is that of the truncated distribution: below the full one's
    assert (truncated.entropy[mask] < full.entropy[mask]).all()


STOP_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789")
"""Single characters (one token each in the character tokenizer): an untrained model hits one often."""


def _same_text(engine_text: str, decoded: str) -> bool:
    """vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 character ("\\ufffd");
    the untrained model samples lone byte tokens often."""
    return engine_text.rstrip("\ufffd") == decoded.rstrip("\ufffd")


def _assert_learner_matches(hf_model, completions, top_k=0, top_p=1.0):
    batch = _batch(completions)
    mask = batch.response_mask > 0
    with torch.no_grad():
        scores = token_scores(
            hf_model,
            batch.input_ids,
            batch.attention_mask,
            batch.response_mask,
            TokenDistribution(TEMPERATURE, top_k, top_p),
        )
    assert scores.outside[mask].sum() == 0
    np.testing.assert_allclose(scores.logprobs[mask].numpy(), batch.behaviour_logprobs[mask].numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_the_tokens_at_the_stop_and_keep_logprobs_consistent(engine, hf_model, include):
    sampling = SamplingConfig(
        n=4, max_tokens=8, temperature=TEMPERATURE, top_k=8, stop=STOP_CHARS, include_stop_str_in_output=include
    )
    completions = engine.generate(PROMPTS, sampling, seed=2)
    decode = engine.tokenizer.decode
    eos = engine.tokenizer.eos_token_id
    stopped = 0
    for c in (c for group in completions for c in group):
        chars = [decode([int(t)], skip_special_tokens=True) for t in c.response_ids]
        # no token after a stop string: only the last token may complete one
        assert not any(ch in STOP_CHARS for ch in chars[:-1]), chars
        if c.finish_reason == "stop" and int(c.response_ids[-1]) != eos:
            stopped += 1
            assert chars[-1] in STOP_CHARS
            kept = [int(t) for t in (c.response_ids if include else c.response_ids[:-1])]
            assert _same_text(c.text, decode(kept, skip_special_tokens=True))  # the text is cut, the tokens are not
    assert stopped >= 5, stopped  # the option was exercised
    _assert_learner_matches(hf_model, completions, top_k=8)


def test_stop_token_ids_stay_in_the_answer_and_keep_logprobs_consistent(engine, hf_model):
    stop_ids = list(range(100, 160))
    sampling = SamplingConfig(n=4, max_tokens=8, temperature=TEMPERATURE, stop_token_ids=stop_ids)
    completions = engine.generate(PROMPTS, sampling, seed=3)
    stopped = 0
    for c in (c for group in completions for c in group):
        ids = [int(t) for t in c.response_ids]
        assert not set(ids[:-1]) & set(stop_ids), ids
        if ids[-1] in stop_ids:
            stopped += 1
            assert c.finish_reason == "stop"
            assert _same_text(c.text, engine.tokenizer.decode(ids[:-1], skip_special_tokens=True))
    assert stopped >= 5, stopped
    _assert_learner_matches(hf_model, completions)


def test_seeds_per_group_reproduce_a_group_wherever_it_sits_in_the_batch(engine):
    from asyncrl.generators.sampling import request_seed

    sampling = SamplingConfig(n=3, max_tokens=8, temperature=TEMPERATURE)
    ids = [f"g{i:08d}" for i in range(len(PROMPTS))]
    seeds = [request_seed(7, g) for g in ids]
    first = engine.generate(PROMPTS, sampling, seed=seeds)
    order = list(reversed(range(len(PROMPTS))))
    again = engine.generate([PROMPTS[i] for i in order], sampling, seed=[seeds[i] for i in order])
    for position, i in enumerate(order):
        for a, b in zip(first[i], again[position]):
            np.testing.assert_array_equal(a.response_ids, b.response_ids)
    other = engine.generate(PROMPTS, sampling, seed=[request_seed(8, g) for g in ids])
    assert any(not np.array_equal(a.response_ids, b.response_ids) for x, y in zip(first, other) for a, b in zip(x, y))


def test_min_tokens_changes_vllms_logprobs_by_the_stop_mass_the_learner_keeps(engine, hf_model):
    """Why training refuses ``min_tokens``: at the first ``min_tokens`` positions vLLM reports
    logprobs renormalised without EOS (log p - log(1 - p(EOS))), the learner the unmasked log p."""
    from asyncrl.generators.engines.vllm_engine import to_completions
    from asyncrl.generators.sampling import sampling_params

    min_tokens = 4
    sampling = SamplingConfig(n=4, max_tokens=8, temperature=TEMPERATURE)
    requests = engine.tokenize_prompts(PROMPTS)
    params = sampling_params(sampling, len(PROMPTS), 4, min_tokens=min_tokens)
    outputs = engine._llm.generate(requests, params, use_tqdm=False)
    eos = engine.tokenizer.eos_token_id
    gaps, after = [], []
    for output in outputs:
        for c in to_completions(output):
            ids = torch.tensor(np.concatenate([c.prompt_ids, c.response_ids]).astype(np.int64))[None]
            with torch.no_grad():
                logp = torch.log_softmax(hf_model(ids).logits[0, :-1].float() / TEMPERATURE, dim=-1)  # (L-1, V)
            rows = torch.arange(len(c.prompt_ids) - 1, ids.shape[1] - 1)
            learner = logp[rows, ids[0, rows + 1]].numpy()
            p_eos = logp[rows, eos].exp().numpy()
            assert len(c.response_ids) >= min_tokens
            expected = learner[:min_tokens] - np.log1p(-p_eos[:min_tokens])
            np.testing.assert_allclose(c.logprobs[:min_tokens], expected, rtol=0, atol=1e-4)
            gaps.extend(c.logprobs[:min_tokens] - learner[:min_tokens])
            after.extend(c.logprobs[min_tokens:] - learner[min_tokens:])
    assert np.mean(gaps) > 1e-3  # measurably off where EOS was masked
    np.testing.assert_allclose(after, 0.0, atol=1e-4)  # and equal once it is not
