"""Sampling consistency against the real vLLM (CPU build) engine: under top-k and top-p the
behaviour logprobs vLLM reports (``processed_logprobs``: the truncated, renormalised
distribution) equal the learner's recomputation of the same sampled tokens, through the learner's
own batch layout; without the truncation the learner would be off by the nucleus's log-mass."""

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

from asyncrl.generators.engine import SamplingConfig  # noqa: E402
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


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7), (8, 0.8)])
def test_learner_logprobs_equal_vllms_under_top_k_and_top_p(engine, hf_model, top_k, top_p):
    sampling = SamplingConfig(n=4, max_tokens=8, temperature=TEMPERATURE, top_k=top_k, top_p=top_p)
    completions = engine.generate(PROMPTS, sampling, seed=1)
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
    batch = collate(groups, [np.zeros(4, np.float32)] * len(groups), pad_id=0)
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
