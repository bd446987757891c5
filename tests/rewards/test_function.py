"""``kind: python``: a user's function, sync or async, in child processes with a timeout."""

import asyncio
import re

import numpy as np
import pytest
from pydantic import ValidationError

from asyncrl.rewards import Unscored
from asyncrl.rewards.base import score_with
from asyncrl.rewards.function import PythonReward, PythonRewardConfig
from asyncrl.rewards.function_child import accepted, load_function, normalize
from asyncrl.rewards.registry import RewardSpec, build_reward
from tests.factories import make_group

FN = "tests.rewards.user_rewards"


def score(function, group, metadata=None, **options):
    """The results of a python reward on ``group``, its children closed afterwards."""
    reward = PythonReward("py", PythonRewardConfig(function=f"{FN}:{function}", **options), metadata)

    async def go():
        try:
            return list(await reward.score(group)), reward
        finally:
            await reward.close()

    return asyncio.run(go())


def test_a_sync_function_scores_each_sample():
    results, _ = score("length", make_group(n=3))
    assert results == [1.0, 1.0, 1.0]


def test_an_async_function_is_awaited():
    group = make_group(n=4)  # texts "0".."3", answer "3"
    results, _ = score("matches", group)
    assert results == [0.0, 0.0, 0.0, 1.0]


def test_a_sequence_is_per_token_rewards_that_travel_with_the_sample():
    group = make_group(n=2, length=5)
    reward = build_reward(RewardSpec(kind="python", options={"function": f"{FN}:per_token"}))
    try:
        asyncio.run(score_with(group, [(reward, 2.0)]))
    finally:
        asyncio.run(reward.close())
    assert group.scored and [s.reward for s in group.samples] == [5.0, 5.0]
    assert np.allclose(group.samples[0].token_rewards, np.full(5, 1.0))


def test_unscored_is_the_functions_own_reason_and_prints_do_not_break_the_protocol():
    results, _ = score("picky", make_group(n=2))
    assert results == [Unscored("no_answer", "the completion is zero"), 1.0]


def test_a_hanging_function_is_killed_and_the_sample_unscored_the_others_scored():
    results, reward = score("hangs_on_one", make_group(n=3), timeout_s=1.0, processes=1)
    assert results[0] == 1.0 and results[2] == 1.0
    assert results[1].reason == "python_timeout"
    assert reward.failures == 1


def test_an_exception_leaves_the_sample_unscored_with_its_type():
    results, _ = score("raises_on_one", make_group(n=3))
    assert results[1] == Unscored("python_error", "ValueError: boom")
    assert results[0] == results[2] == 1.0


def test_a_function_that_kills_its_process_costs_one_sample_and_a_fresh_child():
    results, _ = score("dies_on_one", make_group(n=4), processes=1)
    assert results[1].reason == "python_crashed" and "code 3" in results[1].detail
    assert [results[i] for i in (0, 2, 3)] == [1.0, 1.0, 1.0]


def test_the_row_the_task_and_its_metadata_reach_the_function():
    group = make_group(n=2)
    group.task, group.columns = "words", {"a": 7, "b": 2}
    results, _ = score("from_row", group, metadata={"words": {"scale": 10}})
    assert results == [72.0, 72.0]


def test_a_result_of_another_type_is_unscored_with_a_reason():
    results, _ = score("wrong_type", make_group(n=1))
    assert results[0].reason == "python_bad_result"


def test_an_unscored_sample_leaves_its_group_unscored_and_counted_by_reason():
    group = make_group(n=3)
    reward = build_reward(RewardSpec(kind="python", name="mine", options={"function": f"{FN}:raises_on_one"}))
    try:
        asyncio.run(score_with(group, [(reward, 1.0)]))
    finally:
        asyncio.run(reward.close())
    assert not group.scored
    assert group.unscored_reason == "reward_failed: mine: python_error"


@pytest.mark.parametrize(
    "function, message",
    [
        ("no_colon", "must be 'module:function'"),
        ("tests.rewards.no_such_module:f", "does not import: ModuleNotFoundError"),
        (f"{FN}:absent", "has no attribute 'absent'"),
        (f"{FN}:needs_more", "requires ['reference']"),
        ("missing/file.py:f", "does not exist"),
    ],
)
def test_a_function_that_cannot_be_called_is_an_error_when_the_config_is_read(function, message):
    with pytest.raises(ValidationError, match=re.escape(message)) as error:
        RewardSpec(kind="python", options={"function": function})
    assert repr(function) in str(error.value)


def test_a_file_is_named_relative_to_the_working_directory_and_kept_absolute(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def reward(completion):\n    return 2.5\n")
    monkeypatch.chdir(tmp_path)
    spec = RewardSpec(kind="python", options={"function": "mine.py:reward", "timeout_s": 5})
    assert spec.options["function"] == f"{tmp_path / 'mine.py'}:reward"
    reward = build_reward(spec)
    try:
        assert asyncio.run(reward.score(make_group(n=2))) == [2.5, 2.5]
    finally:
        asyncio.run(reward.close())


def test_arguments_are_given_by_name_and_results_normalized():
    assert accepted(load_function(f"{FN}:from_row")) == ("row", "metadata", "task", "prompt")
    assert accepted(load_function(f"{FN}:picky")) is None  # **kwargs: every argument
    assert normalize(True) == ("ok", 1.0) and normalize(np.float64(2)) == ("ok", 2.0)
    assert normalize([[1.0]])[0] == "unscored"
