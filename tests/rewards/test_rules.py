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
    g.task, g.answer = "no-answer-task", ""  # exact match of a task without answers raises
    score_group(g)
    assert not g.scored and all(s.reward is None for s in g.samples)
    assert g.unscored_reason == "reward_failed: ValueError"


def test_math_verify_checks_equivalence_in_a_child_process():
    import asyncio

    from asyncrl.rewards.rules import MathVerifyReward

    reward = MathVerifyReward(timeout_s=5)
    g = make_group(n=3)
    g.task, g.answer = "gsm8k", "1000"
    for s, text in zip(g.samples, ["the answer is $1000$", "\\boxed{999}", "\\frac{2000}{2}"]):
        s.text = text
    try:
        assert asyncio.run(reward.score(g)) == [1.0, 0.0, 1.0]
    finally:
        asyncio.run(reward.close())


def test_a_hanging_math_verify_is_killed_and_the_answer_unscored():
    import asyncio

    from asyncrl.rewards.base import Unscored
    from asyncrl.rewards.rules import MathVerifyReward

    reward = MathVerifyReward(timeout_s=0.5)
    # A child that hangs on one answer, as math-verify does on some inputs.
    reward.child_code = (
        "import json, sys, time\n"
        "for line in sys.stdin:\n"
        "    gold, answer = json.loads(line)\n"
        "    if answer == 'hang': time.sleep(60)\n"
        "    sys.stdout.write(json.dumps(['ok', float(gold == answer)]) + '\\n'); sys.stdout.flush()\n"
    )
    g = make_group(n=3)
    g.answer = "7"
    for s, text in zip(g.samples, ["7", "hang", "7"]):
        s.text = text
    try:
        results = asyncio.run(reward.score(g))
    finally:
        asyncio.run(reward.close())
    assert results[0] == 1.0 and results[2] == 1.0  # a fresh child took over after the kill
    assert isinstance(results[1], Unscored) and results[1].reason == "math_verify_timeout"
    assert reward.restarts == 1
