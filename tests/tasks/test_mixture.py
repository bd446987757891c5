"""Several sources in one run: their prompts, their held-out split, their own rewards and scores."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from asyncrl.config import RunConfig
from asyncrl.rewards.process import build_rewards, build_rewards_by_task
from asyncrl.rewards.worker import RewardWorker, _Waiting
from asyncrl.tasks.answers import score_answer
from asyncrl.tasks.heldout import EvalConfig, EvalRound
from asyncrl.tasks.prompts import TaskConfig, load_prompts
from asyncrl.wire.endpoints import Endpoints
from tests.factories import make_group

WORDS = [{"question": f"What is {a} plus 1?", "answer": str(a + 1), "a": a} for a in range(6)]


def mix(tmp_path, **task) -> dict:
    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in WORDS))
    words = {"name": "words", "weight": 3, "data": {"train": str(path), "test": str(path)}, "metadata": {"k": 1}}
    return {"name": "mix", "test_size": 4, "sources": [words, {"name": "addition"}], **task}


def test_a_mix_loads_each_source_as_its_own_task_under_ids_that_name_it(tmp_path):
    cfg = TaskConfig(**mix(tmp_path))
    train = load_prompts(cfg, "train")
    assert [p.task for p in train[:6]] == ["words"] * 6 and {p.task for p in train[6:]} == {"addition"}
    assert train[0].prompt_uid == "words/train/0" and train[0].columns == WORDS[0]
    assert train[6].prompt_uid.startswith("addition/")
    test = load_prompts(cfg, "test")
    assert [p.task for p in test[:4]] == ["words", "addition", "words", "addition"] and len(test) == 8
    assert cfg.metadata_by_task() == {"words": {"k": 1}, "addition": {}}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data": {"train": "x.jsonl"}}, "must be unset with task.sources"),
        ({"sources": [{"name": "addition"}, {"name": "addition"}]}, "must be distinct"),
        ({"sources": [{"name": "words"}]}, "'words' is not built in"),
        ({"sources": [{"name": "addition", "weight": 0}]}, "greater than 0"),
    ],
)
def test_a_mix_that_cannot_work_is_an_error_when_the_config_is_read(tmp_path, change, message):
    with pytest.raises(ValidationError, match=message):
        TaskConfig(**mix(tmp_path, **change))


def test_rewards_by_task_must_name_a_task_of_the_run(tmp_path):
    reward = {"by_task": {"chess": [{"kind": "exact_match"}]}}
    with pytest.raises(ValidationError, match=r"reward.by_task \['chess'\] must name tasks of this run"):
        RunConfig(task=mix(tmp_path), reward=reward)


def test_the_reward_worker_scores_each_task_with_its_own_rewards(tmp_path):
    length = {"kind": "python", "name": "length", "options": {"function": "tests.rewards.user_rewards:length"}}
    cfg = RunConfig(task=mix(tmp_path), reward={"by_task": {"words": [length]}})
    ctx = SimpleNamespace(
        name="reward-0", cfg=cfg, endpoints=Endpoints.allocate(), emit=lambda *a, **k: None, stop_requested=bool
    )
    metadata = cfg.task.metadata_by_task()
    worker = RewardWorker(ctx, build_rewards(cfg.reward, metadata), True, build_rewards_by_task(cfg.reward, metadata))
    words, addition = make_group("g1", n=2), make_group("g2", n=2)
    words.task = "words"

    async def score_both():
        try:
            await worker._score(_Waiting(words))
            await worker._score(_Waiting(addition))
        finally:
            for rewards in [worker.rewards, *worker.by_task.values()]:
                for reward, _w in rewards:
                    await reward.close()

    try:
        asyncio.run(score_both())
    finally:
        worker.close()
    assert words.meta["rewards"] == "length" and [s.reward for s in words.samples] == [1.0, 1.0]
    assert addition.meta["rewards"] == "exact_match" and [s.reward for s in addition.samples] == [0.0, 0.0]


def test_the_held_out_score_is_reported_by_task_too(tmp_path):
    prompts = load_prompts(TaskConfig(**mix(tmp_path)), "test")
    right = {"words": lambda p: p.answer, "addition": lambda p: "wrong"}
    r = EvalRound("before", 0, prompts, EvalConfig(chunk_prompts=len(prompts)))
    texts = [right[p.task](p) for p in prompts]
    finish = ["stop"] * len(texts)
    r.answer(
        SimpleNamespace(
            chunk=0,
            version=0,
            generator="g",
            texts=texts,
            finish_reasons=finish,
            samples=[],
            sample_finish_reasons=[],
            seconds=0.1,
        )
    )
    r.score(0, [[score_answer(p.task, t, p.answer)] for p, t in zip(prompts, texts)])
    record = r.record()
    assert record["exact_match"] == 0.5
    assert {t: f["exact_match"] for t, f in record["by_task"].items()} == {"addition": 0.0, "words": 1.0}
