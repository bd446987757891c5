"""The controller's stop waits for processes that joined the run by address, within a bound."""

import logging

import asyncrl.controller.stopping as stopping_module
from asyncrl.controller.commands import CommandSender
from asyncrl.controller.events import EventPump
from asyncrl.controller.reports import ProcessReports
from asyncrl.controller.stopping import Stopper
from asyncrl.controller.watchdog import StallWatch
from asyncrl.wire.messages import EVENTS


class Fleet:
    """The run's own processes: one reward worker, already exited."""

    procs = {"reward-0": None}

    def names(self, role):
        return ["reward-0"] if role == "reward" else []

    def exited(self, names):
        return True


class Events:
    def __init__(self, events):
        self.events = list(events)

    def recv(self, timeout):
        return ("event", self.events.pop(0)) if self.events else None


class Control:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def stopper(events):
    """The stop of a run between training and summary, over scripted events (no duties, no routing)."""
    fleet, reports, receiver = Fleet(), ProcessReports(), Events(events)
    pump = EventPump(receiver, fleet, reports, route=lambda ev: None)
    watch = StallWatch(factor=5, floor_s=120, cap_s=3600, first_s=900)
    return Stopper(fleet, CommandSender(Control()), pump, reports, watch), reports, receiver


def event(source, type, **fields):
    return EVENTS[type](source=source, role="reward", **fields)


def test_the_stop_waits_for_a_joined_workers_final_report():
    stop, reports, receiver = stopper(
        [
            event("reward-hot", "ready"),  # joined mid-run: not one of the fleet's
            event("reward-0", "reward_final", received=4, forwarded=4),
            *[event("reward-hot", "ready")] * 3,  # still draining
            event("reward-hot", "reward_final", received=2, forwarded=2),
        ]
    )
    stop.stop(["reward"])
    assert set(reports.finals) == {"reward-0", "reward-hot"} and reports.joined == {"reward-hot": "reward"}
    assert not receiver.events


def test_a_joined_worker_that_never_reports_is_waited_for_only_so_long(monkeypatch, caplog):
    monkeypatch.setattr(stopping_module, "JOINED_STOP_S", 0.3)
    stop, reports, _ = stopper(
        [event("reward-hot", "ready"), event("reward-0", "reward_final", received=4, forwarded=4)]
    )
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        stop.stop(["reward"])
    assert set(reports.finals) == {"reward-0"}
    assert "reward-hot joined the run and sent no final report within 0 s" in caplog.text
