"""Rotation and compaction of the group ledger: a compacted ledger replays exactly as the lines did."""

import json
import random
import time
import tracemalloc

import pytest

from asyncrl.rundir.ledger import GroupIdSet, LedgerWriter, group_id_of, ledger_segments, read_ledger
from asyncrl.rundir.ledger_replay import CUT_MARGIN_S, compact_ledger, ledger_bytes, reconcile_ledger


def test_a_writer_closes_its_segment_past_the_size_and_every_line_is_read_back(tmp_path):
    w = LedgerWriter(tmp_path, "learner", segment_bytes=200)
    for i in range(20):
        w.write("trained", [group_id_of(i)], version=i)
    w.close()
    names = sorted(p.name for _s, _i, p in ledger_segments(tmp_path))
    assert "learner.jsonl" in names and "learner.1.jsonl" in names and len(names) > 3
    assert all(p.stat().st_size < 200 + 100 for _s, _i, p in ledger_segments(tmp_path))
    lines = read_ledger(tmp_path)
    assert [line["version"] for line in lines] == list(range(20)) and {line["source"] for line in lines} == {"learner"}
    with pytest.raises(ValueError, match=r"segment_bytes \(0\) must be >= 1 or None"):
        LedgerWriter(tmp_path, "x", segment_bytes=0)


def test_group_id_sets_forget_ids_from_a_sequence_number_on():
    ids = GroupIdSet()
    for g in ("g00000001", "g00000009", "g00000020", "external"):
        ids.add(g)
    ids.discard_from(9)
    assert "g00000001" in ids and "g00000009" not in ids and "g00000020" not in ids and "external" in ids
    assert len(ids) == 2 and ids.as_int() == 0b10
    ids.discard("external")
    ids.discard("g00000001")
    assert len(ids) == 0


class History:
    """A random run's ledger lines with explicit times, written to two run directories: one
    left alone, one rotated and compacted at checkpoints as a run's controller does."""

    def __init__(self, rng: random.Random, plain, compacted, lines_per_segment: int = 5):
        self.rng, self.dirs = rng, (plain, compacted)
        self.t, self.version, self.seq = 1000.0, 0, 0
        self.checkpoints = [(0, 0)]  # (version, dispatch horizon)
        self.lines = {}  # source -> lines in its open segment
        self.closed = {}  # source -> segments closed
        self.per_segment = lines_per_segment
        self.open: list[str] = []  # dispatched, not yet settled
        self.trained: list[str] = []

    def write(self, source, event, groups=None, **fields):
        self.t += self.rng.random()
        line = {"t": self.t, "event": event, **fields}
        if groups is not None:
            line["groups"] = groups
        for d in self.dirs:
            folder = d / "ledger"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"{source}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        self.lines[source] = self.lines.get(source, 0) + 1
        if self.lines[source] >= self.per_segment:  # rotate in both: the same files, one compacted
            self.closed[source] = self.closed.get(source, 0) + 1
            for d in self.dirs:
                folder = d / "ledger"
                (folder / f"{source}.jsonl").rename(folder / f"{source}.{self.closed[source]}.jsonl")
            self.lines[source] = 0

    def step(self):
        rng = self.rng
        new = [group_id_of(self.seq + i) for i in range(rng.randint(1, 4))]
        self.seq += len(new)
        self.write("dispatcher", "dispatched", new)
        self.open += new
        if self.open and rng.random() < 0.3:  # a failure: some go out again
            self.write("dispatcher", "dispatched", rng.sample(self.open, min(2, len(self.open))))
        rng.shuffle(self.open)
        k = rng.randint(0, len(self.open))
        train, self.open = self.open[:k], self.open[k:]
        self.version += 1
        if self.trained and rng.random() < 0.1:  # a bug the replay must still see after compaction
            train.append(rng.choice(self.trained))
        if self.open and rng.random() < 0.2:  # partial rollouts: an answer resumed under a newer version
            self.write("generator", "resumed", [rng.choice(self.open)])
        if train:
            self.write("learner", "trained", train, version=self.version)
            self.trained += train
            if rng.random() < 0.3:  # stale segments masked, a sample left with none trained
                self.write("learner", "masked", train[:1], version=self.version, tokens=3, dropped=[train[0] + "/0"])
        if self.trained and rng.random() < 0.5:
            self.write("learner", "retrained", rng.sample(self.trained, 1), version=self.version)
        if self.open and rng.random() < 0.4:
            gone = self.open.pop()
            self.write("buffer", "dropped", [gone], reason=rng.choice(["stale", "evicted"]))
        if self.trained and rng.random() < 0.2:
            self.write("learner", "dropped", [rng.choice(self.trained)], reason="duplicate")
        if rng.random() < 0.05:  # sometimes never settled: lost
            self.open = self.open[1:]
        if self.version % 7 == 0:
            self.checkpoints.append((self.version, self.seq))
        if rng.random() < 0.04:  # a restore to the newest checkpoint, after a Ctrl-C or a crash
            if rng.random() < 0.5:
                self.write("controller", "stop", None, reason="interrupted", version=self.version)
            version, horizon = self.checkpoints[-1]
            self.write("controller", "restore", None, version=version, dispatched=horizon)
            self.version = version

    def compact(self):
        """As the controller does at a commit: fold at the older of the last two checkpoints."""
        fold = self.checkpoints[-2][0] if len(self.checkpoints) > 1 else 0
        self.t += 1
        return compact_ledger(self.dirs[1], fold, now=self.t + CUT_MARGIN_S)


@pytest.mark.parametrize("seed", range(12))
def test_a_compacted_ledger_reconciles_exactly_as_its_lines(tmp_path, seed):
    plain, compacted = tmp_path / "plain", tmp_path / "compacted"
    run = History(random.Random(seed), plain, compacted)
    removed = 0
    for step in range(300):
        run.step()
        if step % 25 == 24:
            removed += run.compact()["removed"]
            assert reconcile_ledger(compacted, 2) == reconcile_ledger(plain, 2)
    run.write("buffer", "held", run.open[:3])
    assert reconcile_ledger(compacted, 2) == reconcile_ledger(plain, 2)
    run.write("controller", "stop", None, reason="interrupted", version=run.version)
    removed += run.compact()["removed"]
    assert reconcile_ledger(compacted, 2) == reconcile_ledger(plain, 2)
    assert reconcile_ledger(plain, 2)["lost"] == 0  # what had no outcome was in flight at the stop
    assert removed > 0 and ledger_bytes(compacted) < ledger_bytes(plain) / 2


def test_a_ledger_is_bounded_to_bits_per_group_over_a_long_run(tmp_path):
    plain, compacted = tmp_path / "plain", tmp_path / "compacted"
    run = History(random.Random(7), plain, compacted, lines_per_segment=50)
    sizes = []
    for step in range(3000):
        run.step()
        if step % 200 == 199:
            run.compact()
            sizes.append(ledger_bytes(compacted))
    # ~4 groups a step: the plain ledger grows by ~100 bytes a group, the compacted one by bits.
    growth = (sizes[-1] - sizes[len(sizes) // 2]) / (run.seq / 2)
    assert growth < 2, (sizes, ledger_bytes(plain))
    assert reconcile_ledger(compacted) == reconcile_ledger(plain)


def test_a_restore_before_the_compaction_is_refused_by_name(tmp_path):
    w = LedgerWriter(tmp_path, "learner", segment_bytes=1)
    w.write("trained", ["g00000000"], version=5)
    compact_ledger(tmp_path, fold_version=5, now=10**12)
    with open(tmp_path / "ledger" / "controller.jsonl", "a") as f:  # after the cut
        f.write(json.dumps({"t": 2e12, "event": "restore", "version": 3, "dispatched": 0}) + "\n")
    with pytest.raises(ValueError, match="restores version 3, before its compaction at version 5"):
        reconcile_ledger(tmp_path)


def test_compaction_streams_the_segments_instead_of_reading_them_whole(tmp_path):
    """A compaction holds one line per source at a time and the replay's state (here bits), so
    its peak memory does not grow with the segments it reads: 40,000 lines (~2.5 MB on disk,
    ~15 MB as parsed lines) are folded within 1 MB of traced memory."""
    w = LedgerWriter(tmp_path, "dispatcher", segment_bytes=1 << 20)
    for seq in range(40_000):
        w.write("dispatched", [group_id_of(seq)])
    w.close()
    assert sum(1 for _s, index, _p in ledger_segments(tmp_path) if index is not None) >= 2
    tracemalloc.start()
    try:
        done = compact_ledger(tmp_path, fold_version=0, now=time.time() + 2 * CUT_MARGIN_S)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert done["removed"] >= 2
    assert peak < 1 << 20, f"compaction peaked at {peak / (1 << 20):.1f} MiB of traced memory"
    assert reconcile_ledger(tmp_path)["dispatched"] == 40_000


def test_a_source_s_segments_replay_in_the_order_written_past_nine(tmp_path):
    """Segment ``.10`` sorts before ``.2`` by name; the replay takes them by index."""
    w = LedgerWriter(tmp_path, "learner", segment_bytes=1)  # every line closes its segment
    for i in range(12):
        w.write("trained", [group_id_of(i)], version=i)
    w.close()
    assert [line["version"] for line in read_ledger(tmp_path)] == list(range(12))
