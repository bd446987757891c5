"""A fake engine for the gateway's tests: deterministic answers, no vLLM."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.generators.completion import Completion
from tests.factories import chatml_char_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return chatml_char_tokenizer(tmp_path_factory.mktemp("tok"))


class FakeEngine:
    """``sample_request`` answers the last ``What is A+B?`` in its context with the sum (else
    ``ok``), then EOS; logprob -0.5 a token, version 7. Records each (context, params)."""

    def __init__(self, tokenizer, version: int = 7):
        self.tokenizer, self.version = tokenizer, version
        self.requests: list[tuple[list[int], object]] = []

    async def sample_request(self, prompt_ids, params, request_id) -> Completion:
        self.requests.append((list(prompt_ids), params))
        context = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        sums = re.findall(r"What is (\d+)\+(\d+)\?", context)
        text = str(int(sums[-1][0]) + int(sums[-1][1])) if sums else "ok"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            response_ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), -0.5, np.float32),
            text=text,
            finish_reason=finish,
            version_segments=[[0, self.version]],
        )


def fake_params(sampling, max_tokens, stop, seed):
    """What ``turn_params`` would pass to vLLM, without vLLM."""
    return SimpleNamespace(
        temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens, stop=stop, seed=seed
    )


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer)
