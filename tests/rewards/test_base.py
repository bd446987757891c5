"""The reward interface: weighted combination, per-token rewards, explicit unscored values, records."""

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from asyncrl import wire
from asyncrl.rewards.base import SyncReward, Unscored, combine, score_with
from asyncrl.rewards.config import RewardConfig
from asyncrl.rewards.registry import RewardSpec, build_reward
from asyncrl.rewards.rules import FormatReward
from tests.factories import make_group


class Constant:
    def __init__(self, name, results):
        self.name, self.results = name, results

    async def score(self, group):
        return self.results

    async def close(self):
        pass


class Length(SyncReward):
    name = "length"

    def score_sync(self, group):
        return [float(len(s.text)) for s in group.samples]


def test_rewards_combine_with_weights_and_record_who_scored():
    group = make_group(n=2)
    rewards = [(Constant("a", [1.0, 0.0]), 0.5), (Length(), 2.0)]
    asyncio.run(score_with(group, rewards))
    assert [s.reward for s in group.samples] == [0.5 + 2.0, 2.0]
    assert group.samples[0].reward_parts == {"a": 1.0, "length": 1.0}
    assert set(group.samples[1].reward_seconds) == {"a", "length"} and group.meta["rewards"] == "a,length"


def test_per_token_rewards_sum_into_the_scalar_and_travel_on_the_wire():
    group = make_group(n=2, length=3)
    tokens = [np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.5, 0.5])]
    combine(group, [("tok", 2.0, tokens, 0.01), ("bonus", 1.0, [1.0, 0.0], 0.0)])
    assert [s.reward for s in group.samples] == [3.0, 3.0]
    np.testing.assert_allclose(group.samples[1].token_rewards, [1.0, 1.0, 1.0])
    _, body = wire.decode(wire.encode_group(group))
    back = body.group.samples[0]
    np.testing.assert_allclose(back.token_rewards, [0.0, 0.0, 2.0])
    assert back.reward_parts == {"tok": 1.0, "bonus": 1.0}


def test_an_unscored_sample_leaves_its_group_unscored_never_zero():
    group = make_group(n=3)
    combine(group, [("a", 1.0, [1.0, Unscored("http_429", "after 4 retries"), 0.0], 0.1)])
    assert all(s.reward is None for s in group.samples) and not group.scored
    assert group.unscored_reason == "reward_failed: a: http_429"
    assert group.unscored_detail == "after 4 retries"


def test_a_crashing_or_miscounting_reward_unscores_the_group():
    class Broken:
        name = "broken"

        async def score(self, group):
            raise RuntimeError("bug")

        async def close(self):
            pass

    group = make_group(n=2)
    asyncio.run(score_with(group, [(Broken(), 1.0)]))
    assert group.unscored_reason == "reward_failed: broken: error: RuntimeError"
    group = make_group(n=2)
    asyncio.run(score_with(group, [(Constant("short", [1.0]), 1.0)]))
    assert group.unscored_reason == "reward_failed: short: error: ValueError"


def test_format_reward_checks_the_pattern():
    group = make_group(n=2)
    group.samples[0].text, group.samples[1].text = "so #### 42", "42"
    assert asyncio.run(FormatReward().score(group)) == [1.0, 0.0]


def test_the_config_checks_reward_options_when_read():
    cfg = RewardConfig(rewards=[{"kind": "exact_match"}, {"kind": "format", "weight": 0.1}])
    assert [s.label for s in cfg.rewards] == ["exact_match", "format"]
    with pytest.raises(ValidationError, match="concurency"):
        RewardConfig(rewards=[{"kind": "http_json", "options": {"url": "http://127.0.0.1:1", "concurency": 3}}])
    with pytest.raises(ValidationError):
        RewardSpec(kind="llm")


def test_the_greedy_baseline_is_scored_with_the_same_rewards():
    from asyncrl.rewards.base import score_greedy_baseline

    rewards = [(build_reward(RewardSpec(kind="exact_match")), 1.0)]
    g = make_group(n=2)  # texts "0", "1"; answer "3"
    g.greedy_text = "3"
    asyncio.run(score_with(g, rewards))
    asyncio.run(score_greedy_baseline(g, rewards))
    assert g.greedy_reward == 1.0 and [s.reward for s in g.samples] == [0.0, 0.0]
