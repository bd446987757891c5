"""Sources mixed by weight: shares held at every prefix, every prompt once per pass, resume."""

import json
from collections import Counter

import pytest

from asyncrl.dispatcher.admission import Admission
from asyncrl.dispatcher.checkpoint import restore_dispatcher, save_dispatcher
from asyncrl.dispatcher.cursor import MixedCursor, PromptCursor, make_cursor
from asyncrl.dispatcher.outstanding import Outstanding
from asyncrl.rundir.ledger import GroupIdSet
from asyncrl.tasks.prompts import Prompt


def prompts(task: str, n: int) -> list[Prompt]:
    return [Prompt(f"{task}/{i}", f"{task} {i}", str(i), task) for i in range(n)]


@pytest.mark.parametrize("weights", [(3.0, 1.0), (1.0, 1.0, 2.0), (0.7, 0.2, 0.1), (5.0,)])
def test_every_prefix_of_the_draws_is_within_one_prompt_of_each_share(weights):
    names = "abcdefg"[: len(weights)]
    cursor = MixedCursor([(prompts(t, 50), w) for t, w in zip(names, weights)], seed=1, epochs=None)
    counts, total = Counter(), sum(weights)
    for n in range(1, 401):
        (p,) = cursor.take(1)
        counts[p.task] += 1
        for t, w in zip(names, weights):
            assert abs(counts[t] - n * w / total) <= 1.0, (n, dict(counts))


def test_each_source_gives_every_prompt_once_per_pass_in_its_own_seeded_order():
    a, b = prompts("a", 10), prompts("b", 30)
    drawn = MixedCursor([(a, 1.0), (b, 3.0)], seed=7, epochs=None).take(40)
    assert sorted(p.prompt_uid for p in drawn) == sorted(p.prompt_uid for p in a + b)
    again = MixedCursor([(a, 1.0), (b, 3.0)], seed=7, epochs=None).take(40)
    assert [p.prompt_uid for p in again] == [p.prompt_uid for p in drawn]
    other = MixedCursor([(a, 1.0), (b, 3.0)], seed=8, epochs=None).take(40)
    assert [p.prompt_uid for p in other] != [p.prompt_uid for p in drawn]


def test_a_source_that_finished_its_epochs_leaves_the_mix_and_the_mix_ends_with_the_last():
    cursor = MixedCursor([(prompts("a", 2), 1.0), (prompts("b", 6), 1.0)], seed=0, epochs=1)
    drawn = cursor.take(100)
    assert Counter(p.task for p in drawn) == {"a": 2, "b": 6}
    assert cursor.take(1) == []


def test_the_dispatchers_checkpoint_keeps_the_mix_position_and_resume_continues_it(tmp_path):
    parts = [(prompts("a", 7), 2.0), (prompts("b", 5), 1.0)]
    cursor = MixedCursor(parts, seed=3, epochs=None)
    cursor.take(20)  # past a pass of each
    ckpt = tmp_path / "v1"
    (ckpt / "buffer").mkdir(parents=True)
    (ckpt / "learner").mkdir()
    (ckpt / "buffer" / "buffer_ids.json").write_text(json.dumps([]))
    (ckpt / "learner" / "trained_ids.bin").write_bytes(GroupIdSet().to_bytes())
    save_dispatcher(ckpt / "dispatcher.json", cursor, Admission(2, 4), Outstanding(), version=1)
    state = json.loads((ckpt / "dispatcher.json").read_text())
    assert state["index"] == 20 and len(state["sources"]) == 2

    resumed = MixedCursor(parts, seed=3, epochs=None)
    restore_dispatcher(ckpt, resumed, Admission(2, 4), Outstanding())
    assert [p.prompt_uid for p in resumed.take(30)] == [p.prompt_uid for p in cursor.take(30)]

    with pytest.raises(ValueError, match="this run's task has 1"):
        MixedCursor(parts[:1], seed=3, epochs=None).restore(state)
    with pytest.raises(ValueError, match="mixes 2 sources, this run's task has none"):
        PromptCursor(parts[0][0], seed=3, epochs=None).restore(state)


def test_make_cursor_groups_a_mixs_prompts_by_task_and_keeps_a_single_task_as_it_was():
    single = make_cursor(prompts("a", 5), None, seed=0, epochs=None)
    assert isinstance(single, PromptCursor)
    assert [p.prompt_uid for p in single.take(5)] == [
        p.prompt_uid for p in PromptCursor(prompts("a", 5), 0, None).take(5)
    ]
    mixed = make_cursor(prompts("a", 4) + prompts("b", 4), {"b": 1.0, "a": 1.0}, seed=0, epochs=None)
    assert [p.task for p in mixed.take(4)] == ["b", "a", "b", "a"]
    with pytest.raises(ValueError, match=r"\['c'\] have no training prompts"):
        make_cursor(prompts("a", 4), {"a": 1.0, "c": 1.0}, seed=0, epochs=None)
