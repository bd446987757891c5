import pytest

from asyncrl.buffer.replay import BufferConfig, ReplayBuffer
from asyncrl.buffer.samplers import FIFOSampler, UniformSampler, make_sampler
from asyncrl.buffer.storage import GroupStorage
from tests.factories import make_group


def scored(gid, version=0, n=4):
    return make_group(gid, n=n, version=version, rewards=[1.0, 0.0, 1.0, 0.0][:n])


def test_fifo_hands_out_oldest_groups_once():
    buf = ReplayBuffer(BufferConfig(capacity_samples=64, max_staleness=None))
    for i in range(5):
        buf.insert(scored(f"g{i}"))
    assert [g.group_id for g in buf.sample(2, learner_version=0)] == ["g0", "g1"]
    assert [g.group_id for g in buf.sample(5, learner_version=0)] == ["g2", "g3", "g4"]
    assert buf.sample(1, learner_version=0) == []
    assert buf.reconcile() == {"inserted": 20, "sampled": 20, "dropped": {}, "held": 0, "held_groups": 0}


def test_staleness_gate_drops_groups_older_than_the_bound():
    buf = ReplayBuffer(BufferConfig(capacity_samples=64, max_staleness=2))
    buf.insert(scored("old", version=0))
    buf.insert(scored("ok", version=1))
    assert not buf.ready(2, learner_version=3)  # "old" is 3 versions behind: dropped
    assert buf.dropped == {"stale": 4}
    assert [g.group_id for g in buf.sample(2, learner_version=3)] == ["ok"]
    assert buf.reconcile()["dropped"] == {"stale": 4}


def test_unscored_groups_are_dropped_with_their_reason():
    buf = ReplayBuffer(BufferConfig(capacity_samples=64))
    g = make_group("u")
    g.meta["unscored_reason"] = "reward_failed: TimeoutError"
    buf.insert(g)
    assert len(buf.storage) == 0 and buf.dropped == {"reward_failed: TimeoutError": 4}
    assert buf.dropped_groups == 1


def test_capacity_is_in_samples_and_reported_as_room():
    buf = ReplayBuffer(BufferConfig(capacity_samples=8))
    buf.insert(scored("a"))
    assert buf.has_room(4)
    buf.insert(scored("b"))
    assert not buf.has_room(4)


def test_storage_refuses_duplicates_and_bad_capacity():
    s = GroupStorage(8)
    s.insert(scored("a"))
    with pytest.raises(KeyError, match="already stored"):
        s.insert(scored("a"))
    with pytest.raises(ValueError, match=r"capacity_samples \(0\) must be >= 1"):
        GroupStorage(0)


def test_uniform_sampler_draws_without_replacement_with_probabilities():
    s = GroupStorage(100)
    for i in range(10):
        s.insert(scored(f"g{i}"))
    ids, probs = UniformSampler(seed=1).select(s, 4)
    assert len(set(ids)) == 4 and list(probs) == [0.4] * 4
    assert FIFOSampler().select(s, 3)[0] == ["g0", "g1", "g2"]
    with pytest.raises(ValueError, match="sampler"):
        make_sampler("prioritised")
