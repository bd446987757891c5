"""The controller's schedule of held-out rounds: a periodic round that falls due while another
runs waits for it (the latest one only), and the round after RL supersedes one still waiting."""

import json
import types

from asyncrl.controller.evaluation import Evaluations
from asyncrl.tasks.heldout import EvalConfig


class Rounds:
    """The evaluator's interface to the schedule: one round at a time, ended by ``finish``."""

    def __init__(self):
        self.current = None
        self.started: list[tuple[str, int]] = []

    def start(self, label, version):
        assert self.current is None, "two rounds at once"
        self.current = types.SimpleNamespace(label=label, version=version)
        self.started.append((label, version))
        return True

    def finish(self):
        r, self.current = self.current, None
        return {"label": r.label, "version": r.version, "exact_match": None}


class Console:
    def eval(self, record):
        pass


def schedule(tmp_path, every=2, total=8):
    rounds = Rounds()
    evals = Evaluations(EvalConfig(every_versions=every), total, tmp_path, Console(), rounds)
    return evals, rounds


def test_a_round_due_while_the_round_before_rl_runs_waits_for_it(tmp_path):
    evals, rounds = schedule(tmp_path)
    rounds.start("before", 0)
    evals.on_step(1)
    evals.on_step(2)  # due while "before" runs
    assert rounds.started == [("before", 0)]
    evals._record(rounds.finish())
    assert rounds.started == [("before", 0), ("v2", 2)]  # started as soon as "before" ended
    evals._record(rounds.finish())
    labels = [json.loads(line)["label"] for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert labels == ["before", "v2"]


def test_only_the_latest_round_due_waits(tmp_path):
    evals, rounds = schedule(tmp_path)
    rounds.start("before", 0)
    for version in range(1, 7):
        evals.on_step(version)
    evals._record(rounds.finish())
    assert rounds.started == [("before", 0), ("v6", 6)]  # v2 and v4 gave way to the latest


def test_the_round_after_rl_supersedes_one_still_waiting(tmp_path):
    evals, rounds = schedule(tmp_path, total=4)
    rounds.start("before", 0)
    evals.on_step(2)
    events = iter([lambda: evals._record(rounds.finish()), lambda: evals._record(rounds.finish())])

    def next_event(_, waiting_for, wait=None):
        next(events)()

    record = evals.run_round("after", 4, next_event)
    assert record["label"] == "after"
    assert rounds.started == [("before", 0), ("after", 4)]
