import numpy as np
import pytest

from asyncrl.generators.engines.mock_engine import MockEngine, MockEngineConfig, simulated_answer
from asyncrl.generators.engines.vllm_engine import SamplingConfig


def test_batch_time_follows_the_timing_model():
    cfg = MockEngineConfig(overhead_s=0.1, prefill_s_per_token=0.01, decode_step_s=0.5, decode_s_per_seq=0.25)
    e = MockEngine(cfg)
    # lengths 1 and 3: steps 1..3 with 2, 1, 1 sequences active
    assert e.batch_seconds(prompt_tokens=10, lengths=np.array([1, 3])) == pytest.approx(0.1 + 0.1 + 3 * 0.5 + 0.25 * 4)


def test_generate_returns_real_sized_groups_with_lengths_from_the_distribution():
    cfg = MockEngineConfig(overhead_s=0, decode_step_s=0, decode_s_per_seq=0, lengths=[2, 5, 100], accuracy=1.0)
    e = MockEngine(cfg, seed=1)
    out = e.generate(["07+45=", "10+10="], SamplingConfig(n=3, max_tokens=50))
    assert [len(g) for g in out] == [3, 3]
    for c in out[0]:
        assert len(c.response_ids) in (2, 5, 50) and c.response_ids.dtype == np.int32
        assert c.logprobs.shape == c.response_ids.shape and (c.logprobs <= 0).all()
        assert c.text == "52" and c.finish_reason == ("length" if len(c.response_ids) == 50 else "stop")


def test_simulated_answers_and_weight_loads():
    assert simulated_answer("07+45=", True) == "52" and simulated_answer("07+45=", False) == "53"
    assert simulated_answer("Question: x", True) != ""
    e = MockEngine(MockEngineConfig(load_weights_s=0))
    e.load_weights("/nowhere", 7)
    assert e.version == 7
    with pytest.raises(ValueError, match="lengths"):
        MockEngineConfig(lengths=[0, 3])
