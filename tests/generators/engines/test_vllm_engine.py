"""Real vLLM (CPU build) tests of ``asyncrl.generators.engines.vllm_engine`` on a tiny Qwen2 model.

The key check is that the behaviour logprobs vLLM returns equal those of an independent
transformers forward pass at the sampling temperature: the learner's importance ratios rely on it.
One engine is built per module (~10 s); the whole file takes well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import os

# vLLM reads these at import time; tests/conftest.py belongs to others, so set them here.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: fast start

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.completion import Completion  # noqa: E402
from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from tests.factories import vllm_engine  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine

PROMPTS = ["1+2=", "34+5=", "hello", "7*8=", "a"]
ATOL = 1e-3


def build_model(out_dir: Path, seed: int) -> Path:
    return Path(build_tiny_model(TinyModelConfig(seed=seed), out_dir))


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, prompt_ids, response_ids, temperature: float = 1.0) -> np.ndarray:
    """log_softmax(logits / T) of each response token given everything before it."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response_ids, dtype=torch.long)[:, None])[:, 0].numpy()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine_models")
    return {"a": build_model(root / "a", seed=0), "b": build_model(root / "b", seed=1)}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    with vllm_engine(tmp_path_factory, models["a"], version=3) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_a(models):
    return load_hf(models["a"])


def test_generate_returns_n_well_formed_completions_per_prompt(engine):
    groups = engine.generate(PROMPTS, SamplingConfig(n=4, max_tokens=6), seed=1)
    assert len(groups) == len(PROMPTS)
    for prompt, group in zip(PROMPTS, groups):
        assert len(group) == 4
        for c in group:
            assert isinstance(c, Completion)
            assert c.prompt_ids.dtype == np.int32 and len(c.prompt_ids) == len(prompt)  # char tokenizer
            assert c.response_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.response_ids.shape == c.logprobs.shape and 1 <= len(c.response_ids) <= 6
            assert np.isfinite(c.logprobs).all() and (c.logprobs <= 0).all()
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.response_ids) == 6


def test_seeded_generate_is_reproducible(engine):
    sampling = SamplingConfig(n=3, max_tokens=5)
    first = engine.generate(PROMPTS[:2], sampling, seed=7)
    again = engine.generate(PROMPTS[:2], sampling, seed=7)
    for g1, g2 in zip(first, again):
        for c1, c2 in zip(g1, g2):
            np.testing.assert_array_equal(c1.response_ids, c2.response_ids)


def test_eos_is_kept_in_response_ids_with_its_logprob(engine):
    # A random tiny model emits EOS (id 1) with probability ~1/100 per token: 512 tokens find some.
    eos = engine.tokenizer.eos_token_id
    groups = engine.generate(PROMPTS, SamplingConfig(n=16, max_tokens=30, temperature=1.5), seed=3)
    stopped = [c for g in groups for c in g if c.finish_reason == "stop"]
    assert stopped, "no sample ended by EOS; raise n or max_tokens"
    for c in stopped:
        assert c.response_ids[-1] == eos and eos not in c.response_ids[:-1]
        assert "<eos>" not in c.text


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(n=4, max_tokens=8, temperature=1.0),
        SamplingConfig(n=4, max_tokens=8, temperature=0.7),
        SamplingConfig(n=4, max_tokens=8, temperature=1.3),
    ],
    ids=lambda s: f"T{s.temperature}",
)
def test_behaviour_logprobs_match_hf_at_the_sampling_temperature(engine, hf_a, sampling):
    groups = engine.generate(PROMPTS, sampling, seed=11)
    worst = 0.0
    for group in groups:
        for c in group:
            expected = hf_logprobs(hf_a, c.prompt_ids, c.response_ids, sampling.temperature)
            worst = max(worst, float(np.abs(c.logprobs - expected).max()))
    assert worst < ATOL


def test_behaviour_logprobs_are_renormalised_over_top_k(engine, hf_a):
    sampling = SamplingConfig(n=4, max_tokens=8, temperature=0.8, top_k=5)
    for group in engine.generate(PROMPTS, sampling, seed=5):
        for c in group:
            ids = torch.tensor([list(c.prompt_ids) + list(c.response_ids)])
            with torch.no_grad():
                logits = hf_a(ids).logits[0, len(c.prompt_ids) - 1 : -1] / 0.8
            kth = logits.topk(5, dim=-1).values[:, -1:]
            masked = logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1)
            expected = masked.gather(-1, torch.tensor(c.response_ids, dtype=torch.long)[:, None])[:, 0].numpy()
            np.testing.assert_allclose(c.logprobs, expected, atol=ATOL)


def test_greedy_is_deterministic_and_matches_hf_argmax(engine, hf_a, models):
    first = engine.greedy(PROMPTS, max_tokens=5)
    assert first == engine.greedy(PROMPTS, max_tokens=5)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["a"])
    ids = tok.encode(PROMPTS[0])
    for _ in range(5):
        with torch.no_grad():
            nxt = int(hf_a(torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        ids.append(nxt)
    assert first[0] == tok.decode(ids[len(tok.encode(PROMPTS[0])) :])


def test_too_long_prompt_is_rejected_by_name(engine):
    with pytest.raises(ValueError, match=r"prompts\[1\] has 64 tokens; it must have fewer than max_model_len \(64\)"):
        engine.generate(["ok", "x" * 64], SamplingConfig(n=2))
    # A prompt that fits but leaves less room than max_tokens is cut at max_model_len.
    for c in engine.generate(["x" * 60], SamplingConfig(n=4, max_tokens=10), seed=0)[0]:
        assert len(c.response_ids) <= 4 and (
            c.finish_reason == "length" or c.response_ids[-1] == engine.tokenizer.eos_token_id
        )


def test_the_generator_guard_refuses_what_vllm_refuses(engine):
    from vllm import SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMValidationError

    from asyncrl.generators.groups import refuse_too_long

    rows = [{"group_id": f"g{i}", "text": "x" * k} for i, k in enumerate((10, 63, 64, 80))]
    taken, refused = refuse_too_long(engine.tokenizer, rows, engine.cfg.max_model_len)
    assert [r["group_id"] for r in refused] == ["g2", "g3"]
    assert len(engine.generate([r["text"] for r in taken], SamplingConfig(n=1, max_tokens=4), seed=0)) == 2
    # vLLM itself refuses a prompt of max_model_len tokens (the whole call fails), not one token less.
    with pytest.raises(VLLMValidationError, match="maximum model length of 64"):
        engine._llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = engine._llm.generate(
        [TokensPrompt(prompt_token_ids=[5] * 63)], SamplingParams(max_tokens=8), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_configs_reject_bad_values():
    with pytest.raises(ValueError, match=r"temperature \(0.0\) must be > 0"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match=r"top_p \(1.5\)"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match=r"n \(0\)"):
        SamplingConfig(n=0)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=1)
    with pytest.raises(ValueError):
        SamplingConfig(temprature=1.0)  # typos are errors


def test_load_weights_swaps_weights_in_place(engine, models, hf_a, tmp_path):
    """B's weights (as a bare save_file dir) then A's again (HF dir): probe + generate follow."""
    from safetensors.torch import save_file

    hf_b = load_hf(models["b"])
    bare = tmp_path / "b_bare"
    bare.mkdir()
    save_file({k: v.contiguous() for k, v in hf_b.state_dict().items()}, str(bare / "model.safetensors"))

    # Longer than one 32-token KV block, so that the prefix cache can hold it (no whitespace:
    # transformers loads a qwen2 dir's tokenizer as Qwen2Tokenizer, which drops it).
    prompt = "0123456789" * 3 + "12+3="
    prompt_ids = engine.tokenizer.encode(prompt)
    continuation = engine.tokenizer.encode("45") + [engine.tokenizer.eos_token_id]
    before = engine.score(prompt, continuation)
    np.testing.assert_allclose(before, hf_logprobs(hf_a, prompt_ids, continuation), atol=ATOL)
    assert len(prompt_ids) > 32
    engine.generate([prompt], SamplingConfig(n=2, max_tokens=4), seed=0)  # fills the prefix cache

    seconds = engine.load_weights(str(bare), version=4)
    assert engine.version == 4 and seconds > 0
    after = engine.score(prompt, continuation)
    assert np.abs(after - before).max() > 1e-2
    np.testing.assert_allclose(after, hf_logprobs(hf_b, prompt_ids, continuation), atol=ATOL)
    # Sampling a prompt seen before must not reuse KV cached under A's weights.
    for c in engine.generate([prompt], SamplingConfig(n=4, max_tokens=6), seed=0)[0]:
        np.testing.assert_allclose(c.logprobs, hf_logprobs(hf_b, c.prompt_ids, c.response_ids), atol=ATOL)

    engine.load_weights(str(models["a"]), version=5)  # a second reload, from a save_pretrained dir
    assert engine.version == 5
    np.testing.assert_allclose(engine.score(prompt, continuation), before, atol=1e-5)


def test_load_weights_rejects_a_dir_missing_weights(engine, tmp_path):
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(128)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        engine.load_weights(str(tmp_path), version=9)
    with pytest.raises(FileNotFoundError):
        engine.load_weights(str(tmp_path / "nowhere"), version=9)
    assert engine.version != 9
