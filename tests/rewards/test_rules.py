from asyncrl.rewards.rules import score_group
from tests.factories import make_group


def test_addition_groups_are_scored_by_exact_match():
    g = make_group(n=4)  # sample texts "0".."3"
    g.answer = "2"
    score_group(g)
    assert [s.reward for s in g.samples] == [0.0, 0.0, 1.0, 0.0]
    assert g.scored and g.meta["rewards"] == "exact_match" and g.reward_s >= 0


def test_gsm8k_groups_use_the_number_after_the_marker():
    g = make_group(n=3)
    g.task, g.answer = "gsm8k", "1000"
    for s, text in zip(g.samples, ["so 2 + 2 ... #### 1,000", "the answer is 1000", "#### 999"]):
        s.text = text
    score_group(g)
    assert [s.reward for s in g.samples] == [1.0, 1.0, 0.0]


def test_a_failing_scorer_leaves_the_group_unscored_with_a_reason_not_zero():
    g = make_group(n=2)
    g.task = "no-such-task"
    score_group(g)
    assert not g.scored and all(s.reward is None for s in g.samples)
    assert g.meta["unscored_reason"] == "reward_failed: ValueError"
