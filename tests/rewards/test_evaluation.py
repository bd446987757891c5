"""Evaluation answers scored by the run's own rewards in the controller: which reward decides,
a rule and a python reward scoring through the scorer's thread, the kinds refused."""

import pytest
from pydantic import ValidationError

from asyncrl.config import RunConfig
from asyncrl.rewards.evaluation import EvalScorer, eval_reward_specs
from asyncrl.rewards.registry import RewardSpec
from asyncrl.tasks.prompts import Prompt

PYTHON = {"kind": "python", "name": "mine", "options": {"function": "tests.rewards.user_rewards:matches"}}


def scored(scorer, prompts, answers):
    try:
        return scorer.submit(prompts, answers).result(60)
    finally:
        scorer.close()


def test_the_default_is_the_first_correctness_reward_and_eval_reward_names_another():
    cfg = RunConfig(reward={"rewards": [{"kind": "format"}, {"kind": "math_verify"}, {"kind": "exact_match"}]})
    assert eval_reward_specs(cfg)["addition"].kind == "math_verify"
    cfg = RunConfig(reward={"rewards": [{"kind": "format"}, PYTHON]})
    assert eval_reward_specs(cfg)["addition"].label == "mine"
    cfg = RunConfig(
        reward={"rewards": [{"kind": "math_verify"}, {"kind": "exact_match"}]}, eval={"reward": "exact_match"}
    )
    assert eval_reward_specs(cfg)["addition"].kind == "exact_match"


def test_a_missing_or_remote_eval_reward_is_a_config_error_naming_it():
    with pytest.raises(ValidationError, match=r"eval.reward \('nope'\) must name one of task 'addition'.s rewards"):
        RunConfig(eval={"reward": "nope"})
    judge = {"kind": "http_json", "name": "judge", "options": {"url": "http://127.0.0.1:1/score"}}
    with pytest.raises(ValidationError, match=r"eval.reward \('judge'\) is of kind http_json"):
        RunConfig(reward={"rewards": [judge]}, eval={"reward": "judge"})
    with pytest.raises(ValidationError, match=r"eval.reward_by_task \['chess'\] must name tasks"):
        RunConfig(eval={"reward_by_task": {"chess": "exact_match"}})
    # a judge alone: evaluation keeps the task's exact match
    assert eval_reward_specs(RunConfig(reward={"rewards": [judge]}))["addition"].kind == "exact_match"


def test_a_rule_reward_scores_each_answer_and_skips_prompts_without_an_answer():
    scorer = EvalScorer({"gsm8k": RewardSpec(kind="exact_match")})
    prompts = [Prompt("a", "Q1", "42", "gsm8k"), Prompt("b", "Q2", "", "gsm8k")]
    answers = [[("so #### 42", "stop"), ("41", "stop"), ("1,000", "length")], [("7", "stop")]]
    assert scored(scorer, prompts, answers) == [[1.0, 0.0, 0.0], None]


def test_a_python_reward_scores_in_its_child_processes_and_unscored_answers_are_none():
    specs = {
        "addition": RewardSpec(**PYTHON),
        "words": RewardSpec(kind="python", options={"function": "tests.rewards.user_rewards:picky"}),
    }
    scorer = EvalScorer(specs)
    prompts = [Prompt("a", "1+1=", "2", "addition"), Prompt("w", "one plus one", "2", "words")]
    answers = [[("2", "stop"), (" 3", "stop")], [("0", "stop"), ("two", "stop")]]
    assert scored(scorer, prompts, answers) == [[1.0, 0.0], [None, 1.0]]
    assert scorer.labels == {"addition": "mine", "words": "python"}
