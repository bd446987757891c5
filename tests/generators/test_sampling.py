"""The ``sampling`` config: options that change the behaviour distribution are refused by name and
reason, neutral values of them pass, and the seeds are a stable function of (run seed, group id)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.config import RunConfig
from asyncrl.generators.sampling import REFUSED, SamplingConfig, request_seed


@pytest.mark.parametrize(
    "key,value",
    [("min_tokens", 2), ("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("frequency_penalty", -0.2)],
)
def test_options_that_change_the_behaviour_distribution_are_refused_naming_key_and_reason(key, value):
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({"sampling": {key: value}})
    message = str(info.value)
    assert f"sampling.{key} ({value!r}) is refused in training" in message
    assert "learner" in message  # the reason: the learner does not reproduce it


def test_neutral_values_of_refused_options_pass():
    cfg = SamplingConfig.model_validate({key: neutral for key, (neutral, _) in REFUSED.items()})
    assert cfg == SamplingConfig()


def test_stop_options_are_checked_and_reach_vllm():
    with pytest.raises(ValidationError, match="stop"):
        SamplingConfig(stop=[""])
    with pytest.raises(ValidationError, match="stop_token_ids"):
        SamplingConfig(stop_token_ids=[-1])
    from asyncrl.generators.sampling import sampling_params

    cfg = SamplingConfig(n=2, stop=["\n\n", "Question:"], stop_token_ids=[7], include_stop_str_in_output=True)
    (params,) = sampling_params(cfg, 1, [123])
    assert params.stop == ["\n\n", "Question:"] and params.stop_token_ids == [7]
    assert params.include_stop_str_in_output and params.seed == 123 and params.logprobs == 0
    with pytest.raises(ValueError, match="one per prompt"):
        sampling_params(cfg, 2, [1])


def test_request_seed_is_stable_per_group_and_run_seed():
    assert request_seed(0, "g00000001") == request_seed(0, "g00000001")
    seeds = {request_seed(0, f"g{i:08d}") for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(1, "g00000001") != request_seed(0, "g00000001")
    assert request_seed(0, "g00000001") == 892158655  # the same in every process and Python version
