"""The probe with a LoRA adapter: serving the base model instead of the adapter fails, serving the adapter passes."""

from __future__ import annotations

import numpy as np
import pytest
from peft import LoraConfig, get_peft_model  # imported once here: its first import takes seconds

from asyncrl.weights.probe import Probe, ProbeCheck, learner_probe
from asyncrl.weights.update import WeightSyncError


class ServedLogprobs:
    """An engine that gives the probe text fixed logprobs (those of the weights it serves)."""

    def __init__(self, logprobs, version: int = 0):
        self.logprobs = np.asarray(logprobs, np.float32)
        self.version = version

    def score(self, prompt, continuation_ids):
        return self.logprobs


BASE = np.linspace(-3.0, -0.5, 24)
ADAPTER = BASE + np.where(np.arange(24) % 2, 0.2, -0.2)  # mean |adapter - base| = 0.2


def probe_body(adapter, previous, base=BASE) -> dict:
    return Probe("12+34=", list(range(24)), list(adapter), 2, 1, list(previous), list(base)).to_wire()


def test_serving_the_base_instead_of_the_adapter_fails_even_within_a_loose_bound():
    check = ProbeCheck(atol=0.5)  # uncalibrated and loose (a bfloat16 side): |base - adapter| = 0.2 is within it
    body = probe_body(ADAPTER, previous=BASE)
    with pytest.raises(WeightSyncError, match="serves the base model, not the adapter"):
        check.check(ServedLogprobs(BASE + 1e-3), body, version=2)
    stats = check.check(ServedLogprobs(ADAPTER + 1e-3), body, version=2)
    assert stats.base_diff == pytest.approx(0.2, abs=2e-3) and stats.base_separation == pytest.approx(0.2)


def test_once_calibrated_the_base_is_told_apart_from_an_adapter_a_few_noises_away():
    check = ProbeCheck(atol=0.15)
    check.noise = 0.05  # bfloat16-like numerics: tol = 0.25 > |adapter - base| = 0.2
    body = probe_body(ADAPTER, previous=BASE)
    noise = np.where(np.arange(24) % 3, 0.05, -0.05)
    with pytest.raises(WeightSyncError, match="serves the base model"):
        check.check(ServedLogprobs(BASE + noise), body, version=2)
    assert check.check(ServedLogprobs(ADAPTER + noise), body, version=2).mean_diff == pytest.approx(0.05, abs=1e-6)


def test_a_fresh_adapter_that_equals_the_base_passes_and_says_so():
    check = ProbeCheck(atol=1e-2)
    fresh = BASE.copy()  # peft starts lora_B at zero: the adapter is the base model
    stats = check.check(ServedLogprobs(BASE + 1e-5), probe_body(fresh, previous=BASE), version=2)
    assert stats.base_separation == 0.0 and stats.base_diff == pytest.approx(stats.mean_diff)


def test_without_base_logprobs_the_check_is_the_full_weights_one():
    body = Probe("12+34=", list(range(24)), list(ADAPTER), 2, 1, list(BASE)).to_wire()
    with pytest.raises(WeightSyncError, match="still serves version 1"):
        ProbeCheck(atol=1e-2).check(ServedLogprobs(BASE), body, version=2)


def test_base_logprobs_travel_to_the_next_probe_and_are_checked_for_length():
    probe = Probe.from_wire(probe_body(ADAPTER, BASE))
    nxt = probe.after(3, list(ADAPTER + 0.1))
    assert nxt.base_logprobs == probe.base_logprobs and nxt.previous_logprobs == probe.logprobs
    with pytest.raises(WeightSyncError, match="base_logprobs has 2 values"):
        Probe.from_wire({**probe_body(ADAPTER, BASE), "base_logprobs": [0.0, 0.0]})


def test_learner_probe_of_a_peft_model_sends_the_base_logprobs_too():
    import torch

    from tests.factories import small_qwen2

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) % 64 for c in text]

    plain = small_qwen2(64)
    body = learner_probe(plain, Tok(), max_len=40)
    assert "base_logprobs" not in body
    model = get_peft_model(plain, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.3)
    body = learner_probe(model, Tok(), max_len=40)
    base, adapter = np.array(body["base_logprobs"]), np.array(body["logprobs"])
    assert len(base) == len(adapter) == 39 - len("12+34=") + 1 - 1
    assert np.abs(base - adapter).mean() > 1e-3
    with model.disable_adapter():
        assert learner_probe(model, Tok(), max_len=40)["logprobs"] == body["base_logprobs"]
