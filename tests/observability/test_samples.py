"""The samples a learner step shares: picked whole by group, cut, carried by a declared event,
written one line per answer with a bounded file, and printed by ``asyncrl inspect --samples``."""

from __future__ import annotations

import json

import msgspec
import numpy as np

from asyncrl.cli import main
from asyncrl.learner.sample_report import pick_groups, sample_texts
from asyncrl.observability.samples import FILE, ROTATED, SamplesLog, format_samples, read_last, samples_markdown
from asyncrl.wire import decode, encode
from asyncrl.wire.messages import SamplesEvent
from asyncrl.wire.schema import Episode, Group, Sample


def group(index: int, policy_version: int = 3, n: int = 2) -> Group:
    samples = [
        Sample(
            f"g{index}/{i}",
            np.arange(4, dtype=np.int32),
            np.zeros(4, np.float32),
            f"answer {i} " * 10,
            "stop",
            reward=float(i),
            reward_parts={"correct": float(i), "format": 0.5},
            version_segments=[[0, policy_version], [2, policy_version + 1]] if i else None,
        )
        for i in range(n)
    ]
    return Group(
        f"g{index}",
        f"p{index}",
        "addition",
        f"What is {index}+1?",
        str(index + 1),
        np.arange(3, dtype=np.int32),
        policy_version,
        "generator-0",
        samples,
    )


def test_whole_groups_are_picked_reproducibly_and_their_answers_carry_reward_versions_and_staleness():
    groups = [group(i) for i in range(10)]
    picked = pick_groups(groups, 3, seed=0, version=5)
    assert len(picked) == 3 and picked == pick_groups(groups, 3, seed=0, version=5)
    assert [g.group_id for g in picked] == sorted(g.group_id for g in picked)  # in batch order
    assert pick_groups(groups, 0, 0, 5) == [] and pick_groups(groups[:2], 3, 0, 5) == groups[:2]

    texts = sample_texts([group(0, policy_version=3)], version=6, max_chars=20)
    assert [t.uid for t in texts] == ["g0/0", "g0/1"]
    assert texts[1].reward == 1.0 and texts[1].reward_parts == {"correct": 1.0, "format": 0.5}
    assert texts[1].policy_version == 3 and texts[1].version_segments == [[0, 3], [2, 4]]
    assert texts[0].staleness == 6 - 1 - 3  # the learner's version before the step minus the oldest token's
    assert len(texts[0].completion) == 20 and texts[0].completion.endswith("…") and texts[0].tokens == 4

    # declared on the wire: a samples event decodes to its type with its records
    kind, ev = decode(encode(SamplesEvent(source="learner", role="learner", version=6, samples=texts)))
    assert kind == "event" and isinstance(ev, SamplesEvent) and ev.samples == texts


def records(version: int, groups=2) -> list[dict]:
    texts = sample_texts([group(i) for i in range(groups)], version=version, max_chars=200)
    ev = SamplesEvent(source="learner", role="learner", version=version, samples=texts)
    return [{"version": version, **s} for s in msgspec.to_builtins(ev.samples)]


def test_the_file_gets_a_line_per_answer_rotates_at_its_bound_and_inspect_prints_the_last(tmp_path, capsys):
    log = SamplesLog(tmp_path, max_bytes=4000)
    for version in range(1, 9):
        log.write(records(version))
    lines = [json.loads(line) for line in (tmp_path / FILE).read_text().splitlines()]
    expected = {"version", "uid", "group_id", "prompt_uid", "task", "prompt", "answer", "completion", "reward"}
    assert expected | {"reward_parts", "policy_version", "staleness", "finish_reason", "tokens", "generator"} <= set(
        lines[0]
    )
    # bounded: rotated once full, at most twice the bound on disk, the newest lines in samples.jsonl
    assert (tmp_path / ROTATED).exists() and (tmp_path / FILE).stat().st_size <= 4000
    assert lines[-1]["version"] == 8
    last = read_last(tmp_path, 6)  # spans the rotated file when the current one holds fewer
    assert [r["version"] for r in last][-1] == 8 and len(last) == 6

    text = format_samples(last[-4:])
    assert "== step 8 · g0 · addition · p0 · from generator-0" in text
    assert "reward 1 (correct 1, format 0.5) | version 3, staleness 4 | 4 tokens, stop" in text
    assert "What is 1+1?" in text and "answer 1 answer 1" in text
    markdown = samples_markdown(last[-4:])
    assert "**g1**" in markdown and "staleness 4" in markdown

    assert main(["inspect", str(tmp_path), "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("-- g") == 2 and "== step 8 · g1" in out
    assert main(["inspect", str(tmp_path), "--samples", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["uid"] == "g1/1"
    assert main(["inspect", str(tmp_path / "none"), "--samples"]) == 0
    assert "no samples yet" in capsys.readouterr().out


def test_an_episode_is_shared_whole_with_its_turns_and_printed_with_the_environments_answers_marked():
    g = group(7, n=1)
    sample = g.samples[0]
    sample.response_ids = np.array([ord(c) for c in "8lower3"], np.int32)
    mask = np.array([1, 0, 0, 0, 0, 0, 1], np.uint8)
    sample.logprobs = np.where(mask == 1, -0.5, 0.0).astype(np.float32)
    sample.version_segments, sample.text, sample.episode = None, "3", Episode("g7/0", mask, turns=2)
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    (text,) = sample_texts([g], version=4, max_chars=200, decode=decode)
    assert (text.turns, text.masked_tokens, text.transcript, text.completion) == (2, 5, "8⟦lower⟧3", "3")
    record = msgspec.to_builtins(text)
    printed = format_samples([{**record, "version": 4}])
    assert "2 turns, 5 tokens the environment's" in printed and "8⟦lower⟧3" in printed
    (single,) = sample_texts([group(8, n=1)], version=4, max_chars=200, decode=decode)
    assert single.transcript is None and single.turns == 1
