"""The learner's batches under reuse (``buffer.max_times_sampled != 1``): a copy of a group that
was trained before, dispatched again after a buffer restart, is not trained or counted again."""

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.config import RunConfig
from asyncrl.learner.batch_requests import BatchRequester
from asyncrl.learner.totals import Counters
from asyncrl.observability.step_stats import StepStats
from asyncrl.rundir.ledger import GroupIdSet, LedgerWriter
from asyncrl.rundir.ledger_replay import reconcile_ledger
from asyncrl.wire.messages import Batch as BatchReply
from asyncrl.wire.messages import BufferFinal, GeneratorFinal, LearnerFinal, RewardFinal
from tests.factories import make_group


class BufferClient:
    """A learner's request client answered by a ``ReplayBuffer`` in the same thread; ``buf`` may
    be swapped for a fresh one, as a buffer process restarted empty."""

    def __init__(self, buf: ReplayBuffer):
        self.buf = buf

    def request(self, message, timeout):
        if len(self.buf) < message.num_groups:  # the rate limiter is not what this test is about
            return "batch", BatchReply()
        batch = self.buf.sample(message.num_groups)
        return "batch", BatchReply(
            groups=list(batch.items),
            group_keys=batch.keys.tolist(),
            probabilities=batch.probabilities.tolist(),
            is_weights=batch.is_weights.tolist(),
            **_repeats(batch),
        )

    def receive(self, timeout):
        return None

    def close(self):
        pass


def _repeats(batch) -> dict:
    """The reply's per-group flag of a repeated hand-out, as the buffer service sends it."""
    return {"repeat": (~batch.first_time).tolist()}


def _scored(group_id: str, version: int):
    return make_group(group_id, version=version, rewards=[1.0, 0.0, 1.0, 0.0])


def _reuse(max_times: int = 2) -> tuple[RunConfig, ReplayBuffer]:
    cfg = RunConfig(
        buffer={"max_times_sampled": max_times, "sampler": "fifo", "max_staleness": None},
        learner={"batch_groups": 1},
    )
    return cfg, ReplayBuffer.from_config(BufferConfig(**cfg.buffer.model_dump()))


def _train(batches: BatchRequester, version: int) -> list[str]:
    """One learner step: what it trained (the ids), as ``run_learner`` reports it."""
    batch = batches.receive(version)
    if batch is None:
        return []
    batches.trained(batch, version + 1)
    return [g.group_id for g in batch.groups]


def _restart_empty(batches: BatchRequester, cfg: RunConfig) -> ReplayBuffer:
    """The buffer process dies and comes back empty (``supervision``: the dispatcher then hands
    out again every group it has not heard was trained)."""
    batches.client.buf = ReplayBuffer.from_config(BufferConfig(**cfg.buffer.model_dump()))
    return batches.client.buf


def test_a_copy_dispatched_again_after_a_buffer_restart_is_not_trained_again(tmp_path):
    cfg, buf = _reuse(max_times=2)
    counters = Counters()
    LedgerWriter(tmp_path, "dispatcher").write("dispatched", ["g00000001"])
    ledger = LedgerWriter(tmp_path, "learner")
    batches = BatchRequester(BufferClient(buf), cfg, ledger, counters, GroupIdSet())
    buf.insert(_scored("g00000001", 0))
    assert _train(batches, 0) == ["g00000001"]  # its first hand-out
    # The buffer dies before the dispatcher heard that g1 was trained; a generator samples a
    # new copy under the same id, at a later version.
    _restart_empty(batches, cfg).insert(_scored("g00000001", 1))
    assert _train(batches, 1) == []
    assert counters.dropped["duplicate"] == 4
    ledger.close()
    out = reconcile_ledger(tmp_path)
    assert out["trained"] == 1 and out["trained_twice"] == 0 and out["lost"] == 0


def test_reuse_trains_a_group_as_often_as_the_buffer_allows_and_a_copy_never(tmp_path):
    cfg, buf = _reuse(max_times=2)
    counters = Counters()
    LedgerWriter(tmp_path, "dispatcher").write("dispatched", ["g00000001", "g00000002"])
    ledger = LedgerWriter(tmp_path, "learner")
    batches = BatchRequester(BufferClient(buf), cfg, ledger, counters, GroupIdSet())
    first = []
    buf.insert(_scored("g00000001", 0))
    batch = batches.receive(0)
    first.append(batches.trained(batch, 1)[0])
    batch = batches.receive(1)  # the buffer's second hand-out of the same copy: reuse
    assert [g.group_id for g in batch.groups] == ["g00000001"] and batch.repeat == [True]
    first.append(batches.trained(batch, 2)[0])
    assert first == [4, 0]  # its samples count once as trained
    # A copy of g1 after a restart, handed out twice by the new buffer: refused both times.
    buf = _restart_empty(batches, cfg)
    buf.insert(_scored("g00000001", 2))
    buf.insert(_scored("g00000002", 2))
    assert _train(batches, 2) == []  # g1's copy; the batch is empty, asked again
    assert _train(batches, 2) == []  # g1's copy handed out again (FIFO: the oldest until retired)
    assert _train(batches, 2) == ["g00000002"]
    assert _train(batches, 3) == ["g00000002"]  # g2's reuse
    assert counters.dropped["duplicate"] == 8 and len(buf) == 0
    ledger.close()
    out = reconcile_ledger(tmp_path)
    assert out["trained"] == 2 and out["trained_twice"] == 0 and out["lost"] == 0
    assert out["retrained"] == 2 and out["retrained_untrained"] == 0


def test_a_reply_with_one_repeat_flag_per_group_only_is_accepted():
    import pytest

    from asyncrl.wire.schema import WireError

    with pytest.raises(WireError, match="1 repeat flags for 2 groups"):
        BatchReply(groups=[_scored("g00000001", 0), _scored("g00000002", 0)], repeat=[True]).check()


def test_stale_segments_leave_the_loss_and_a_sample_with_none_trained_is_dropped_stale(tmp_path):
    """Partial rollouts (mask): no sample disappears. A group whose oldest tokens are past the
    bound is kept by the gate, its stale tokens masked; a sample with every token stale is counted
    as dropped ``stale`` by the learner, in its counters, the ledger and the run's summary."""
    from asyncrl.buffer.stale_segments import mark_trained_from
    from asyncrl.controller.accounting import summarize

    cfg = RunConfig(buffer={"max_staleness": 2, "sampler": "fifo"}, learner={"batch_groups": 2})
    buf = ReplayBuffer.from_config(BufferConfig(**cfg.buffer.model_dump()), partial_rollouts="mask")
    buf.set_learner_version(5)
    spanning = _scored("g00000001", 2)
    for sample, segments in zip(spanning.samples, ([[0, 2], [1, 4]], None, [[0, 3]], [[0, 3]])):
        sample.version_segments = segments  # the second answer: version 2 only, too stale at 5
    buf.insert(spanning)
    buf.insert(_scored("g00000002", 4))
    LedgerWriter(tmp_path, "dispatcher").write("dispatched", ["g00000001", "g00000002"])
    ledger, counters = LedgerWriter(tmp_path, "learner"), Counters()
    batches = BatchRequester(BufferClient(buf), cfg, ledger, counters, GroupIdSet())
    batch = batches.receive(5)
    mark_trained_from(batch.groups, 5, cfg.buffer.max_staleness)  # as the buffer service does at hand-out
    assert [s.trained_from for s in batch.groups[0].samples] == [1, 3, 0, 0]
    first_time, dropped = batches.trained(batch, 6)
    assert (first_time, dropped) == (7, 1) and counters.dropped == {"stale": 1}
    stats = StepStats(version=6, loss=0.0, tokens=24, staleness_mean=1.0, staleness_max=1, step_s=0.1)
    stats.staleness, stats.token_staleness, stats.stale_tokens_masked = [1] * 7, {1: 20}, 4
    counters.add_step(batch.groups, stats, first_time, dropped)
    assert counters.trained_with_reuse == 7 and counters.segments_hist == {1: 6, 2: 1}
    ledger.close()

    replayed = reconcile_ledger(tmp_path, samples_per_group=4)
    assert replayed["trained"] == 7 and replayed["dropped"] == {"stale": 1} and replayed["lost"] == 0
    assert replayed["stale_tokens_masked"] == 4
    learner = LearnerFinal(
        version=6,
        trained=counters.trained,
        trained_with_reuse=counters.trained_with_reuse,
        dropped=dict(counters.dropped),
        staleness_hist={"1": 7},
        token_staleness_hist={str(k): v for k, v in counters.token_staleness_hist.items()},
        segments_hist={str(k): v for k, v in counters.segments_hist.items()},
        stale_tokens_masked=counters.stale_tokens_masked,
        busy_s=1.0,
        wall_s=2.0,
    )
    generator = GeneratorFinal(generated=8, tokens=24, version=6, busy_s=1, wall_s=2)
    rewards = RewardFinal(received=8, forwarded=8)
    buffer = BufferFinal(**buf.reconcile())
    summary = summarize({"g": generator, "r": rewards, "b": buffer, "l": learner}, 1.0, None, None)
    assert summary["reconciles"] and all(v == 0 for v in summary["unaccounted_by_link"].values())
    assert summary["dropped"] == {"stale": 1} and summary["trained"] == 7
    assert summary["partial_rollouts"] == {"resumed": 0, "stale_tokens_masked": 4, "stale_samples_dropped": 1}
    assert summary["versions_per_sample"] == {"1": 6, "2": 1}
    assert summary["token_staleness_hist"] == {"1": 20}
