"""What the controller does when a process dies: restart it after its backoff and requeue what it
held, restore the whole run for the learner or the dispatcher, stop the run outside training."""

import pytest

from asyncrl.controller.commands import CommandSender
from asyncrl.controller.errors import RunError
from asyncrl.controller.reports import ProcessReports, TrainingProgress
from asyncrl.controller.supervision import Supervisor
from asyncrl.fleet.config import SupervisionConfig


class Fleet:
    def __init__(self, roles):
        self.roles, self.died, self.restarted = roles, {}, []

    def dead(self):
        return dict(self.died)

    def restart(self, name, extra_env):
        self.restarted.append(name)
        self.died.pop(name)


class Control:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def supervisor(tmp_path, **cfg):
    progress = TrainingProgress(generator_versions={"generator-1": 3})
    s = Supervisor(SupervisionConfig(backoff_initial_s=0, **cfg), tmp_path, ProcessReports(), progress)
    s.training = True
    return s, CommandSender(Control())


def test_a_dead_generator_is_restarted_and_its_prompts_requeued(tmp_path):
    s, commands = supervisor(tmp_path)
    fleet = Fleet({"generator-1": "generator"})
    fleet.died["generator-1"] = -9
    assert s.check(fleet, commands) is None
    (body,) = commands.publisher.sent
    assert body.command == "requeue" and body.scope == "generator" and body.generator == "generator-1"
    assert list(commands.unacked) == [body.id]  # resent until the dispatcher answers
    assert fleet.restarted == ["generator-1"] and "generator-1" not in s.progress.generator_versions
    assert [d["name"] for d in s.deaths] == ["generator-1"]


def test_a_dead_learner_asks_for_a_restore(tmp_path):
    s, commands = supervisor(tmp_path)
    fleet = Fleet({"learner": "learner"})
    fleet.died["learner"] = 1
    assert s.check(fleet, commands) == "learner died (exit code 1)"


def test_a_death_outside_training_or_past_the_restarts_stops_the_run(tmp_path):
    s, commands = supervisor(tmp_path)
    s.training = False
    fleet = Fleet({"reward-0": "reward"})
    fleet.died["reward-0"] = 1
    with pytest.raises(RunError, match="process reward-0 died \\(exit code 1\\)"):
        s.check(fleet, commands)
    s, commands = supervisor(tmp_path, max_restarts=0)
    with pytest.raises(RunError, match="after 0 restarts: giving up"):
        s.check(fleet, commands)
