"""What the controller does when a process dies: restart it after its backoff and requeue what it
held, restore the whole run for the learner or the dispatcher, stop the run outside supervision
and when a restarted process fails again with the same error."""

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
    s.supervising = s.training = True
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


def test_a_death_outside_supervision_or_past_the_restarts_stops_the_run(tmp_path):
    s, commands = supervisor(tmp_path)
    s.supervising = s.training = False
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


def test_a_death_during_start_up_is_handled_as_in_training(tmp_path):
    s, commands = supervisor(tmp_path)
    s.training = False  # started, not yet told go (or evaluating before RL)
    fleet = Fleet({"generator-0": "generator"})
    fleet.died["generator-0"] = -9
    assert s.check(fleet, commands) is None and fleet.restarted == ["generator-0"]


def _failed(s, fleet, commands, error):
    from asyncrl.wire.messages import ErrorEvent

    s.on_error(ErrorEvent(source="generator-0", role="generator", error=error))
    fleet.died["generator-0"] = 1
    return s.check(fleet, commands)


def test_the_same_failure_after_a_restart_stops_the_run_with_its_reason(tmp_path):
    s, commands = supervisor(tmp_path)
    fleet = Fleet({"generator-0": "generator"})
    probe = "WeightSyncError: probe after applying version {}: differ by {} on average > 0.05"
    _failed(s, fleet, commands, probe.format(2, 0.0732))
    assert fleet.restarted == ["generator-0"]
    with pytest.raises(RunError, match="failed again after a restart with the same error.*version 3: differ by 0.0741"):
        _failed(s, fleet, commands, probe.format(3, 0.0741))  # other figures, the same failure


def test_a_different_failure_after_a_restart_is_restarted_again(tmp_path):
    s, commands = supervisor(tmp_path)
    fleet = Fleet({"generator-0": "generator"})
    _failed(s, fleet, commands, "TimeoutError: waited 60 s for bucket 2 of version 5")
    _failed(s, fleet, commands, "WeightSyncError: checksum mismatch")
    assert fleet.restarted == ["generator-0", "generator-0"]


def test_the_error_reported_after_the_death_is_seen_was_the_same(tmp_path):
    """The error event and the exit travel apart: the repeat is caught whichever comes first."""
    from asyncrl.wire.messages import ErrorEvent

    s, commands = supervisor(tmp_path)
    fleet = Fleet({"generator-0": "generator"})
    _failed(s, fleet, commands, "ValueError: bad 1")
    fleet.died["generator-0"] = 1  # died again; its error arrives later
    s.check(fleet, commands)
    with pytest.raises(RunError, match="same error"):
        s.on_error(ErrorEvent(source="generator-0", role="generator", error="ValueError: bad 2"))
