"""One declared type for a learner step's statistics: a misspelt name fails where it is set, read
or listed, the steps.jsonl line keeps its keys, and ``asyncrl inspect`` reads the line back by field."""

import json
import math

import msgspec
import pytest

from asyncrl.observability import console, inspect_run
from asyncrl.observability.step_stats import StepStats, check_names
from asyncrl.wire import decode, encode
from asyncrl.wire.messages import StepEvent


def stats(**measured) -> StepStats:
    figures = dict(loss=0.25, tokens=40, staleness_mean=0.5, staleness_max=1, reward=0.75, accuracy=0.5)
    figures |= dict(version=2, samples=8, wait_s=0.1, step_s=0.3, staleness=[0, 1])
    return StepStats(**{**figures, **measured})


def test_a_misspelt_statistic_fails_where_it_is_set_read_or_listed():
    with pytest.raises(TypeError, match="clipfrc"):
        stats(clipfrc=0.1)
    with pytest.raises(AttributeError, match="clipfrc"):
        _ = stats().clipfrc
    with pytest.raises(AttributeError, match=r"readers: \['mismatch_k1'\] are not StepStats fields"):
        check_names(("mismatch_kl", "mismatch_k1"), "readers")
    # the lists the readers keep were checked when they were imported
    listed = [key for _label, key, _fmt in console.CELLS] + [*console.LINE_EXTRAS, *inspect_run.RUN_STEP]
    assert set(listed) <= set(StepStats.__struct_fields__)


def test_the_steps_jsonl_line_keeps_its_keys_and_reads_back():
    event = StepEvent(
        source="learner", role="learner", stats=stats(mismatch_kl=math.nan, behaviour_kl_by_staleness={1: 0.02})
    )
    _, received = decode(encode(event))
    line = json.dumps(received.record(t=4.0))  # as the controller appends it
    record = json.loads(line)
    before = {"type", "source", "role", "version", "loss", "reward", "accuracy", "tokens", "samples", "wait_s"}
    before |= {"step_s", "staleness_mean", "staleness_max", "t", "mismatch_kl", "behaviour_kl_by_staleness"}
    assert before <= set(record) and "staleness" not in record and "entropy" not in record
    back = StepStats.from_record(record)
    assert back.version == 2 and back.behaviour_kl_by_staleness == {1: 0.02} and math.isnan(back.mismatch_kl)
    with pytest.raises(msgspec.ValidationError):
        StepStats.from_record({"type": "step", "t": 1.0})  # not a step's line


def test_inspect_reads_the_last_step_by_field(tmp_path):
    lines = [StepEvent(source="learner", role="learner", stats=stats(version=v)).record(t=v) for v in (1, 2, 3)]
    lines[-1]["accuracy"] = None  # no correctness reward ran
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    row = inspect_run.run_row(tmp_path)
    assert row["status"] == "live" and row["step"] == 3 and row["reward"] == 0.75 and row["staleness_mean"] == 0.5
    assert "accuracy" not in row


def test_plot_reads_the_steps_by_field(tmp_path):
    from asyncrl.observability.plot import load_steps, plot_run, throughput

    lines = [StepEvent(source="learner", role="learner", stats=stats(version=v)).record(t=2.0 * v) for v in (1, 2)]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "summary.json").write_text(json.dumps({"staleness_hist": {"0": 5, "1": 3}}))
    steps = load_steps(tmp_path)
    assert [(t, s.version) for t, s in steps] == [(2.0, 1), (4.0, 2)]
    assert throughput(steps) == ([2.0, 4.0], [4.0, 4.0], [20.0, 20.0])  # 8 samples, 40 tokens every 2 s
    assert plot_run(tmp_path).stat().st_size > 10_000
