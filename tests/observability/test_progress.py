"""An evaluation record's figures go to the step loggers at the version it was asked at, the
episode figures with them when its prompts were played as episodes."""

import io

from asyncrl.observability.console import RunConsole
from asyncrl.observability.progress import RunProgress


class Loggers:
    def __init__(self):
        self.logged: list[tuple[dict, int]] = []

    def log_scalars(self, scalars, version):
        self.logged.append((scalars, version))


def progress() -> RunProgress:
    """A ``RunProgress`` with a quiet console and recording loggers (no run directory, no server)."""
    p = RunProgress.__new__(RunProgress)
    p.console, p.loggers = RunConsole("quiet", total_steps=10, out=io.StringIO()), Loggers()
    return p


def test_an_eval_of_episodes_logs_its_turns_tool_calls_and_failures_and_one_of_answers_does_not():
    record = {"label": "v4", "version": 4, "exact_match": 0.5, "completed": 1.0, "completed_accuracy": 0.5}
    episodes = {"episode_turns": 2.5, "episode_tool_calls": 1.0, "episode_tool_errors": 0.25, "env_failures": 1}
    p = progress()
    p.eval({**record, **episodes, "sets": {"hard": {"exact_match": 0.0, "episode_turns": 4.0}}})
    logged = {k: v for scalars, version in p.loggers.logged for k, v in scalars.items() if version == 4}
    assert logged["eval/episode_turns"] == 2.5 and logged["eval/episode_tool_calls"] == 1.0
    assert logged["eval/episode_tool_errors"] == 0.25 and logged["eval/env_failures"] == 1
    assert logged["eval/hard/episode_turns"] == 4.0
    p = progress()
    p.eval(record)
    assert not any("episode" in k or "env_" in k for scalars, _ in p.loggers.logged for k in scalars)
