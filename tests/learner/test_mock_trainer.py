import pytest

from asyncrl.learner.mock_trainer import MockTrainer, MockTrainerConfig
from tests.factories import make_group


def test_mock_trainer_counts_staleness_and_versions_like_the_real_one():
    t = MockTrainer(MockTrainerConfig(step_overhead_s=0, s_per_token=0, weight_bytes=64))
    groups = [make_group("a", version=0, rewards=[1.0, 0.0, 0.0, 0.0]), make_group("b", version=0, rewards=[0.0] * 4)]
    stats = t.train_step(groups)
    assert t.version == 1 and stats["staleness"] == [0] * 8 and stats["tokens"] == 8 * (3 + 3)
    stats = t.train_step(groups)
    assert stats["staleness"] == [1] * 8 and stats["reward_mean"] == pytest.approx(1 / 8)
    assert t.full_state_dict()["weights"].numel() == 16
    assert t.step_seconds(100) == 0
