import math

import pytest

from asyncrl.learner.mock_trainer import MockTrainer, MockTrainerConfig
from tests.factories import make_group


def test_mock_trainer_counts_staleness_and_versions_like_the_real_one():
    t = MockTrainer(MockTrainerConfig(step_overhead_s=0, s_per_token=0, weight_bytes=64))
    groups = [make_group("a", version=0, rewards=[1.0, 0.0, 0.0, 0.0]), make_group("b", version=0, rewards=[0.0] * 4)]
    stats = t.train_step(groups)
    assert t.version == 1 and stats.staleness == [0] * 8 and stats.tokens == 8 * 3  # response tokens, as the real one
    stats = t.train_step(groups)
    assert stats.staleness == [1] * 8 and stats.reward == pytest.approx(1 / 8)
    assert t.full_state_dict()["weights"].numel() == 16
    assert t.step_seconds(100) == 0


def test_mock_trainer_publishes_a_real_models_tensors_when_asked(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(tmp_path / "model.safetensors"))
    t = MockTrainer(MockTrainerConfig(weights_from=str(tmp_path)))
    assert list(t.full_state_dict()) == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="holds no"):
        MockTrainer(MockTrainerConfig(weights_from=str(tmp_path / "none"))).full_state_dict()


def test_mock_trainer_models_off_policy_signals_growing_with_staleness():
    t = MockTrainer(MockTrainerConfig(step_overhead_s=0, s_per_token=0, behaviour_kl_per_version=0.01))
    t.version = 3
    stats = t.train_step([make_group("a", version=3, rewards=[1.0] * 4), make_group("b", version=1, rewards=[0.0] * 4)])
    assert stats.behaviour_kl_by_staleness == {0: 0.0, 2: pytest.approx(0.02)}
    # log-normal weights: E[w^2] = e^{2 KL}; half the tokens at KL 0, half at 0.02
    assert stats.behaviour_ess == pytest.approx(1 / ((1 + math.exp(0.04)) / 2))
    on_policy = MockTrainer(MockTrainerConfig(step_overhead_s=0, s_per_token=0)).train_step(
        [make_group("c", rewards=[0.0] * 4)]
    )
    assert on_policy.behaviour_ess == 1.0 and on_policy.behaviour_kl_by_staleness == {0: 0.0}


def test_mock_trainer_signals_leave_out_samples_with_every_token_masked_as_too_stale():
    t = MockTrainer(MockTrainerConfig(step_overhead_s=0, s_per_token=0, behaviour_kl_per_version=0.01))
    t.version = 3
    group = make_group("a", version=1, rewards=[1.0, 0.0, 0.0, 0.0])
    for s in group.samples:
        s.version_segments = [[0, 1], [2, 3]]
        s.trained_from = 2  # the buffer masked version 1's tokens
    group.samples[0].trained_from = len(group.samples[0].response_ids)  # every token masked: not trained
    stats = t.train_step([group])
    assert stats.staleness == [0, 0, 0] and stats.stale_tokens_masked == 3 * 2 + 3
    assert stats.stale_samples_masked == 1 and stats.behaviour_ess == 1.0
