"""The controller's stop waits for processes that joined the run by address, within a bound."""

import logging

import asyncrl.controller.process as controller_module
from asyncrl.controller.process import Controller
from asyncrl.controller.watchdog import StallWatch


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

    def send(self, kind, body):
        self.sent.append(body)


class Progress:
    def update(self, ev):
        pass


def stopping_controller(events):
    """A controller between training and summary: only what ``_stop`` touches."""
    c = object.__new__(Controller)
    c.fleet, c.events, c.control, c.progress = Fleet(), Events(events), Control(), Progress()
    c.finals, c.joined, c.last_event, c.last_event_at = {}, {}, {}, {}
    c._supervise = c._resend = lambda: None
    c.watch = StallWatch(factor=5, floor_s=120, cap_s=3600, first_s=900)
    c.heldout = None
    return c


def event(source, type, **fields):
    return {"source": source, "role": "reward", "type": type, **fields}


def test_the_stop_waits_for_a_joined_workers_final_report():
    c = stopping_controller(
        [
            event("reward-hot", "ready"),  # joined mid-run: not one of the fleet's
            event("reward-0", "final", received=4),
            *[event("reward-hot", "heartbeat")] * 3,  # still draining
            event("reward-hot", "final", received=2),
        ]
    )
    c._stop(["reward"])
    assert set(c.finals) == {"reward-0", "reward-hot"} and c.joined == {"reward-hot": "reward"}
    assert not c.events.events


def test_a_joined_worker_that_never_reports_is_waited_for_only_so_long(monkeypatch, caplog):
    monkeypatch.setattr(controller_module, "JOINED_STOP_S", 0.3)
    c = stopping_controller([event("reward-hot", "ready"), event("reward-0", "final", received=4)])
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        c._stop(["reward"])
    assert set(c.finals) == {"reward-0"}
    assert "reward-hot joined the run and sent no final report within 0 s" in caplog.text
