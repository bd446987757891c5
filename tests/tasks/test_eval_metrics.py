"""The figures of an evaluation round: pass@k against brute force, mean@k, completed correctness."""

import itertools
import math

import pytest

from asyncrl.tasks.eval_metrics import PromptScore, pass_at_k, round_metrics


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of the k-subsets of the n samples that hold at least one correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_brute_force_over_every_subset(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k)), (n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match=r"c \(5\) must be in \[0, n \(4\)\]"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match=r"k \(5\) must be in \[1, n \(4\)\]"):
        pass_at_k(4, 1, 5)


def score(greedy, ended, samples=(), samples_ended=()):
    return PromptScore("addition", "test", greedy, ended, list(samples), list(samples_ended))


def test_greedy_accuracy_beside_completed_correctness():
    scores = [
        score(1.0, True),  # right, ended
        score(0.0, True),  # wrong, ended
        score(0.0, False),  # cut at max tokens: wrong for its length
        score(None, False),  # the reward could not score it: wrong, counted
    ]
    m = round_metrics(scores, correct_at=1.0, samples_k=0)
    assert m["exact_match"] == 0.25
    assert m["completed"] == 0.5 and m["completed_accuracy"] == 0.5
    assert m["unscored"] == 1 and m["num_scored"] == 4
    assert "pass_at_k" not in m


def test_mean_and_pass_at_k_over_sampled_answers():
    scores = [
        score(1.0, True, [1.0, 0.0, 0.0, 0.0], [True, True, False, True]),
        score(0.0, True, [0.0, 0.0, 0.0, 0.0], [True] * 4),
        score(0.0, False, [0.5, 1.0, 1.0, 1.0], [False, True, True, True]),  # 0.5 < correct_at
    ]
    m = round_metrics(scores, correct_at=1.0, samples_k=4)
    assert m["mean_at_k"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert m["pass_at_k"] == pytest.approx(2 / 3)  # k = n: a prompt passes if any sample is right
    assert m["pass_at"]["1"] == pytest.approx(m["mean_at_k"])  # pass@1 is the mean correctness
    assert m["pass_at"]["2"] == pytest.approx((pass_at_k(4, 1, 2) + 0 + pass_at_k(4, 3, 2)) / 3)
    assert m["sampled_completed"] == pytest.approx(10 / 12)
    assert m["sampled_completed_accuracy"] == pytest.approx(4 / 10)  # 1 + 0 + 3 right among the 10 ended
    # a lower threshold counts the 0.5 as right
    assert round_metrics(scores, correct_at=0.5, samples_k=4)["mean_at_k"] == pytest.approx((1 / 4 + 0 + 1) / 3)


def played(greedy, turns, calls, errors, failed, samples=()):
    s = score(greedy, True, samples, [True] * len(samples))
    s.turns, s.tool_calls, s.tool_errors, s.env_failed = list(turns), list(calls), list(errors), list(failed)
    return s


def test_episode_figures_beside_the_score_greedy_and_sampled_apart():
    scores = [  # per prompt: the greedy episode, then two sampled
        played(1.0, [2, 3, 1], [1, 2, 0], [0, 1, 0], [False, False, False], [1.0, 0.0]),
        played(None, [4, 1, 2], [3, 0, 1], [3, 0, 1], [True, False, True], [0.0, None]),
    ]
    m = round_metrics(scores, correct_at=1.0, samples_k=2, episodes=True)
    assert m["exact_match"] == 0.5 and m["unscored"] == 2
    assert m["episode_turns"] == 3.0 and m["episode_tool_calls"] == 2.0 and m["episode_tool_errors"] == 1.5
    assert m["sampled_episode_turns"] == pytest.approx((3 + 1 + 1 + 2) / 4)
    assert m["sampled_episode_tool_calls"] == pytest.approx(3 / 4)
    assert m["sampled_episode_tool_errors"] == pytest.approx(2 / 4)
    assert m["env_failures"] == 2  # the second prompt's greedy and second sampled episodes
    greedy_only = round_metrics([played(1.0, [2], [1], [0], [False])], correct_at=1.0, samples_k=0, episodes=True)
    assert "sampled_episode_turns" not in greedy_only and greedy_only["episode_turns"] == 2.0


def test_episodes_from_a_generator_that_sends_no_turns_count_failures_only_and_answers_none():
    s = score(0.0, True)
    s.env_failed = [True]  # env_errors came, turns and tool calls did not
    m = round_metrics([s], correct_at=1.0, samples_k=0, episodes=True)
    assert m["episode_turns"] is None and m["episode_tool_calls"] is None and m["env_failures"] == 1
    assert "episode_turns" not in round_metrics([score(1.0, True)], correct_at=1.0, samples_k=0)
