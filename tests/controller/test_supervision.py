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


def test_a_joined_process_silent_past_the_timeout_is_taken_for_dead_and_its_work_requeued(tmp_path):
    from asyncrl.wire.messages import HeartbeatEvent

    s, commands = supervisor(tmp_path, joined_timeout_s=10)
    reports = s.reports
    for name, role in (("gen-hot-1", "generator"), ("reward-hot-2", "reward")):
        reports.record(HeartbeatEvent(source=name, role=role), started_here=False)
    beat = reports.last_event_at["gen-hot-1"]
    s.check_joined(reports, commands, now=beat + 9)
    assert commands.publisher.sent == [] and s.deaths == []
    reports.last_event_at["reward-hot-2"] = beat + 9  # the reward worker beats on
    s.check_joined(reports, commands, now=beat + 11)
    (body,) = commands.publisher.sent
    assert body.command == "requeue" and body.scope == "generator" and body.generator == "gen-hot-1"
    assert [(d["name"], d["joined"]) for d in s.deaths] == [("gen-hot-1", True)]
    assert reports.joined_without_final(["generator", "reward"]) == ["reward-hot-2"]  # the stop waits for no ghost
    s.check_joined(reports, commands, now=beat + 30)  # reported once
    assert len(s.deaths) == 2 and s.deaths[1]["name"] == "reward-hot-2"
    assert commands.publisher.sent[1].scope == "in_flight"
    reports.record(HeartbeatEvent(source="gen-hot-1", role="generator"), started_here=False)  # it was only slow
    s.check_joined(reports, commands, now=reports.last_event_at["gen-hot-1"] + 1)
    assert "gen-hot-1" in reports.joined and "gen-hot-1" not in s.silent and len(s.deaths) == 2
