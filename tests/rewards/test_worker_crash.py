"""A reward worker whose loop crashes ends without a final report: a process that reported one
has finished, and the controller would take its exit for the end of its work, neither
restarting it nor stopping the run (a run then waited for its stall bound, every group unscored)."""

import pytest

from asyncrl.config import RunConfig
from asyncrl.rewards import process
from tests.factories import RecordingContext


class CrashingWorker:
    closed = False

    def __init__(self, *args, **kwargs):
        pass

    async def run(self):
        raise TypeError("cannot unpack non-iterable NoneType object")

    def final_report(self):
        raise AssertionError("a crashed worker reported a final")

    def close(self):
        CrashingWorker.closed = True


def test_a_crashed_reward_worker_reports_no_final_and_raises(monkeypatch):
    monkeypatch.setattr(process, "RewardWorker", CrashingWorker)
    ctx = RecordingContext()
    ctx.cfg, ctx.name = RunConfig(), "reward-0"
    with pytest.raises(TypeError, match="cannot unpack"):
        process.run_reward_worker(ctx)
    assert ctx.events == [] and CrashingWorker.closed
