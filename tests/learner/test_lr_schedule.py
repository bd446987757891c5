"""The learning-rate schedule as a function of the update index."""

import math

import pytest

from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.lr_schedule import lr_factor


def test_warmup_rises_linearly_to_the_peak_from_the_first_update():
    assert [lr_factor(s, "constant", 4, 100, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_decay_reach_the_floor_at_the_last_update_and_stay():
    # warm-up 2, decay over updates 2..10, floor 0.1
    linear = [lr_factor(s, "linear", 2, 10, 0.1) for s in range(12)]
    assert linear[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert linear[6] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert linear[10:] == pytest.approx([0.1, 0.1])
    cosine = [lr_factor(s, "cosine", 2, 10, 0.1) for s in range(12)]
    assert cosine[2] == pytest.approx(1.0)
    assert cosine[4] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert cosine[6] == pytest.approx(0.55)
    assert cosine[10:] == pytest.approx([0.1, 0.1])
    assert all(a >= b for a, b in zip(cosine[1:], cosine[2:]))  # never rises after the warm-up


def test_no_warmup_starts_at_the_peak():
    assert lr_factor(0, "cosine", 0, 10, 0.0) == 1.0
    assert lr_factor(0, "linear", 0, 10, 0.0) == 1.0


def test_bad_schedule_values_are_named():
    with pytest.raises(ValueError, match=r"lr_decay_steps \(5\) must be > lr_warmup_steps \(5\)"):
        TrainerConfig(lr_schedule="cosine", lr_warmup_steps=5, lr_decay_steps=5)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        TrainerConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="lr_schedule"):
        TrainerConfig(lr_schedule="exponential")
    with pytest.raises(ValueError, match=r"step \(-1\) must be >= 0"):
        lr_factor(-1, "constant", 0, 1, 0.0)
