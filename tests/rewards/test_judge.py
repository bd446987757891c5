"""What the HTTP rewards make of replies: real judge phrasings, content parts, capture groups,
out-of-range scores; every odd reply leaves its sample unscored with a reason, never its group."""

import asyncio

import pytest
from pydantic import ValidationError

from asyncrl.rewards.base import Unscored
from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward, JudgeConfig, OpenAIJudgeReward
from tests.factories import make_group
from tests.rewards.fault_server import FaultServer


@pytest.fixture
def server():
    s = FaultServer(lambda key, attempt, body: ("ok", 1.0))
    yield s
    s.close()


def judge(url: str = "http://127.0.0.1:9/v1/chat/completions", **options) -> OpenAIJudgeReward:
    return OpenAIJudgeReward("judge", JudgeConfig(url=url, timeout_s=2, max_retries=0, **options))


def chat(content) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": content}}]}


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("7", 7),
        ("Rating (0-10): 7", 7),
        ("Score: 8/10", 8),
        ("I would rate this 8 out of 10.", 8),
        ("**Score:** 9", 9),
        ("The answer 42 is correct, matching the reference 42.\n\nScore: 10", 10),
        ("Score: 10 (great)", 10),
        ("6.5", 6.5),
        ("On a scale of 0 to 10, this deserves a 3.", 3),
    ],
)
def test_the_default_pattern_reads_real_judge_phrasings(text, score):
    assert judge().parse_score(chat(text)) == pytest.approx(score / 10)


def test_content_that_is_not_a_string():
    reward = judge()
    parts = [{"type": "text", "text": "Reasoning: fine. "}, {"type": "text", "text": "Score: 6"}]
    assert reward.parse_score(chat(parts)) == pytest.approx(0.6)
    assert reward.parse_score(chat(5)) == pytest.approx(0.5)
    assert reward.parse_score(chat({"score": 5})).reason == "bad_reply"
    assert reward.parse_score(chat(None)).reason == "bad_reply"
    assert reward.parse_score(chat([{"type": "image_url"}])).reason == "unparsable_score"
    assert reward.parse_score({"choices": []}).reason == "bad_reply"


def test_a_capture_group_is_the_score():
    reward = judge(score_pattern=r"Score: (\d+)")
    assert reward.parse_score(chat("Score: 8, confidence 0.9")) == pytest.approx(0.8)
    named = judge(score_pattern=r"(?P<label>[A-Z]+)=(?P<score>\d+)", score_match="first")
    assert named.parse_score(chat("A=4 B=9")) == pytest.approx(0.4)
    optional = judge(score_pattern=r"Score(?:: (\d+))?")
    assert optional.parse_score(chat("Score")).reason == "unparsable_score"  # the group took no part


def test_judge_options_are_checked_when_read():
    with pytest.raises(ValidationError, match="score_pattern"):
        JudgeConfig(url="http://x", score_pattern="(")
    with pytest.raises(ValidationError, match="prompt_template"):
        JudgeConfig(url="http://x", prompt_template="Rate {response} on {scale}")
    with pytest.raises(ValidationError, match=r"min_score \(10.0\) must be < max_score \(10.0\)"):
        JudgeConfig(url="http://x", min_score=10)
    with pytest.raises(ValidationError, match=r"min_score \(1.0\) must be <= max_score \(0.0\)"):
        JsonScorerConfig(url="http://x", min_score=1, max_score=0)


def test_odd_replies_leave_only_their_own_sample_unscored(server):
    contents = {0: "Score: 7", 1: [{"type": "text", "text": "8"}], 2: 9, 3: {"text": "7"}, 4: "none", 5: "10/10"}
    server.behaviour = lambda key, attempt, body: ("chat", contents[int(key.rsplit("/", 1)[1])])
    reward = judge(server.url)
    results = asyncio.run(_score_and_close(reward, make_group("odd", n=6)))
    assert results[:3] == [pytest.approx(0.7), pytest.approx(0.8), pytest.approx(0.9)] and results[5] == 1.0
    assert [results[3].reason, results[4].reason] == ["bad_reply", "unparsable_score"]


def test_the_json_scorer_checks_its_range(server):
    values = [0.5, 1e9, -5, 1.5, 1.0, 0.0]
    server.behaviour = lambda key, attempt, body: ("ok", values[int(key.rsplit("/", 1)[1])])
    reward = JsonScorerReward("ranged", JsonScorerConfig(url=server.url, min_score=0, max_score=1, max_retries=0))
    results = asyncio.run(_score_and_close(reward, make_group("r", n=6)))
    assert [results[0], results[4], results[5]] == [0.5, 1.0, 0.0]
    assert all(isinstance(r, Unscored) and r.reason == "score_out_of_range" for r in results[1:4])
    by_default = JsonScorerReward("default-range", JsonScorerConfig(url=server.url, max_retries=0))
    results = asyncio.run(_score_and_close(by_default, make_group("d", n=6)))  # [0, 1] unless widened
    assert [results[0], results[4], results[5]] == [0.5, 1.0, 0.0]
    assert [r.reason for r in results[1:4]] == ["score_out_of_range"] * 3 and "1000000000" in results[1].detail
    widened = JsonScorerConfig(url=server.url, min_score=None, max_score=None, max_retries=0)
    unbounded = JsonScorerReward("unbounded", widened)
    assert asyncio.run(_score_and_close(unbounded, make_group("u", n=6))) == values


def test_the_judge_takes_its_scale_from_its_template(server):
    replies = {0: "5", 1: "1", 2: "0", 3: "7"}
    server.behaviour = lambda key, attempt, body: ("chat", replies[int(key.rsplit("/", 1)[1])])
    cfg = JudgeConfig(url=server.url, prompt_template="Rate {response} from 1 to 5.", max_retries=0)
    assert (cfg.min_score, cfg.max_score) == (1.0, 5.0)
    results = asyncio.run(_score_and_close(OpenAIJudgeReward("scale5", cfg), make_group("s", n=4)))
    assert results[:2] == [1.0, 0.2] and [r.reason for r in results[2:]] == ["score_out_of_range"] * 2
    assert JudgeConfig(url="http://x", prompt_template="from 1 to 5 {response}", max_score=10).max_score == 10


def test_every_kind_declares_its_range_and_a_result_outside_it_is_unscored():
    from asyncrl.rewards.base import score_with
    from asyncrl.rewards.registry import RewardSpec, build_reward

    class Wild:
        name = "wild"
        score_range = (0.0, 1.0)

        async def score(self, group):
            return [0.5, 1e9, -5.0]

        async def close(self):
            pass

    group = make_group("w", n=3)
    asyncio.run(score_with(group, [(Wild(), 1.0)]))
    assert group.unscored_reason == "reward_failed: wild: score_out_of_range" and "1000000000" in group.unscored_detail
    for kind in ("exact_match", "math_verify"):
        assert build_reward(RewardSpec(kind=kind)).score_range == (0.0, 1.0)
    assert build_reward(RewardSpec(kind="format", options={"value": 0.5})).score_range == (0.0, 0.5)
    judge = build_reward(RewardSpec(kind="openai_judge", options={"url": "http://127.0.0.1:9"}))
    assert judge.score_range == (0.0, 1.0)
    scorer = build_reward(RewardSpec(kind="http_json", options={"url": "http://127.0.0.1:9"}))
    assert scorer.score_range == (0.0, 1.0)


def test_two_rewards_scoring_one_sample_send_different_keys(server):
    group = make_group("k", n=3)
    first, second = (JsonScorerReward(name, JsonScorerConfig(url=server.url)) for name in ("helpful", "harmless"))

    async def both():
        await asyncio.gather(first.score(group), second.score(group))
        await first.close()
        await second.close()

    asyncio.run(both())
    expected = {f"{name}:{s.uid}" for name in ("helpful", "harmless") for s in group.samples}
    assert set(server.keys) == expected and set(server.keys.values()) == {1}


async def _score_and_close(reward, group):
    try:
        return await reward.score(group)
    finally:
        await reward.close()


def test_every_option_of_the_http_kinds_documents_itself():
    for model in (JsonScorerConfig, JudgeConfig):
        assert [name for name, field in model.model_fields.items() if not field.description] == []
