"""Episodes are played by an environment or by an agent program, never both, and on what runs
them: each refusal names the keys, the values and the rule when the config is read."""

import pytest

from asyncrl.config import load_config

GUESS = "asyncrl.tasks.environments.guess_number:GuessNumber"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [f"environment.cls={GUESS}", "agent.command=[python, agent.py]"],
            "environment.cls (asyncrl.tasks.environments.guess_number:GuessNumber) and agent.command (['python', 'agent.py']) are both set",
        ),
        (
            ["agent.command=[python, agent.py]", "generator.greedy_baseline=true"],
            "generator.greedy_baseline (True) must be false, with agent.command",
        ),
        ([f"environment.cls={GUESS}", "eval.engine=hf"], "eval.engine (hf) must be generators"),
        (
            ["agent.command=[python, agent.py]", "generator.partial_rollouts=resume"],
            "generator.partial_rollouts (resume) must not be resume yet (an agent's call is not resumed)",
        ),
        (
            ["environment.cls=asyncrl.tasks.environments.http:HttpEnvironment", "environment.options={urll: x}"],
            "environment.options.urll is not an option",
        ),
    ],
)
def test_episodes_refuse_what_cannot_play_them(overrides, expected):
    with pytest.raises(ValueError, match="") as refused:
        load_config("configs/demo.yaml", overrides)
    assert expected in str(refused.value), str(refused.value)


def test_either_scheduler_plays_episodes_and_an_environment_resumes_them():
    for mode in ("continuous", "batch"):
        cfg = load_config("configs/guess_number.yaml", [f"generator.mode={mode}"])
        assert cfg.plays_episodes and cfg.generator.mode == mode
    assert load_config("configs/guess_number.yaml", ["generator.partial_rollouts=resume"]).plays_episodes
