import numpy as np
import pytest

from asyncrl.buffer import snapshot as snapshot_module
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.buffer.storage import SlabStorage
from tests.factories import make_group

CFG = dict(
    capacity_samples=96,
    max_times_sampled=3,
    max_staleness=3,
    samples_per_insert=2.0,
    error_buffer=50,
    recency_decay=0.9,
    seed=7,
)


def busy_buffer(sampler="prioritized") -> ReplayBuffer:
    buf = ReplayBuffer.from_config(BufferConfig(**CFG, sampler=sampler))
    rng = np.random.default_rng(0)
    for i in range(30):  # more than the capacity: evictions; versions that go stale
        buf.set_learner_version(i // 6)
        buf.insert(make_group(f"g{i}", version=i // 6, rewards=rng.integers(0, 2, 4).astype(float).tolist()))
        if i % 3 == 2:
            batch = buf.sample(3)
            buf.update_priorities(batch.keys, rng.random(len(batch)))
    return buf


def draws(buf, n=6):
    out = []
    for i in range(n):
        batch = buf.sample(4)
        out.append(
            (
                [g.group_id for g in batch.items],
                batch.probabilities.round(12).tolist(),
                batch.is_weights.round(12).tolist(),
                batch.keys.tolist(),
            )
        )
        buf.insert(make_group(f"after{i}", version=buf.learner_version, rewards=[1.0, 0.0, 0.0, 0.0]))
    return out


@pytest.mark.parametrize("sampler", ["prioritized", "uniform", "fifo"])
def test_restore_gives_the_same_state_and_the_same_next_samples(tmp_path, sampler):
    buf = busy_buffer(sampler)
    buf.snapshot(tmp_path / "snap")
    restored = ReplayBuffer.from_config(BufferConfig(**CFG, sampler=sampler))
    restored.restore(tmp_path / "snap")
    assert restored.reconcile() == buf.reconcile()
    assert restored.removed == buf.removed and restored.learner_version == buf.learner_version
    assert restored.rate_limiter.state() == buf.rate_limiter.state()
    assert draws(restored) == draws(buf)
    assert restored.reconcile() == buf.reconcile()


def test_slab_buffer_restores_payloads(tmp_path):
    fields = {"tokens": ((5,), np.int32), "logprobs": ((5,), np.float32)}
    cfg = BufferConfig(capacity_samples=32, max_times_sampled=None, seed=1)
    buf = ReplayBuffer.from_config(cfg, storage=SlabStorage(32, fields))
    rng = np.random.default_rng(0)
    rows = {
        "tokens": rng.integers(0, 100, (40, 5)).astype(np.int32),
        "logprobs": -rng.random((40, 5)).astype(np.float32),
    }
    for lo in (0, 20):  # 40 into room for 32: evictions
        buf.insert_batch({k: v[lo : lo + 20] for k, v in rows.items()}, np.zeros(20, dtype=np.int64), rng.random(20))
    with pytest.raises(ValueError, match=r"a batch of 40 items exceeds the buffer's capacity \(32 items\)"):
        buf.insert_batch(rows, np.zeros(40, dtype=np.int64), rng.random(40))
    buf.snapshot(tmp_path / "snap")
    restored = ReplayBuffer.from_config(cfg, storage=SlabStorage(32, fields))
    restored.restore(tmp_path / "snap")
    a, b = buf.sample(8), restored.sample(8)
    assert a.keys.tolist() == b.keys.tolist()
    for name in fields:
        np.testing.assert_array_equal(a.items[name], b.items[name])


def test_snapshots_are_atomic_and_restores_are_checked(tmp_path, monkeypatch):
    buf = busy_buffer()
    buf.snapshot(tmp_path / "snap")
    with pytest.raises(FileExistsError, match="exists"):
        buf.snapshot(tmp_path / "snap")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(snapshot_module.np, "savez", fail)
    with pytest.raises(OSError, match="disk full"):
        buf.snapshot(tmp_path / "broken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]  # no partial snapshot, no temp dir
    monkeypatch.undo()

    with pytest.raises(ValueError, match="restore needs a fresh buffer"):
        buf.restore(tmp_path / "snap")
    other = ReplayBuffer.from_config(BufferConfig(**{**CFG, "capacity_samples": 64}))
    with pytest.raises(ValueError, match=r"snapshot max_items \(96\) differs from this buffer's \(64\)"):
        other.restore(tmp_path / "snap")
    with pytest.raises(FileNotFoundError, match="not a snapshot"):
        ReplayBuffer.from_config(BufferConfig(**CFG)).restore(tmp_path)
