"""Batch mode runs any rollout: a batch's groups start together on the engine's event loop, the
batch waits for all of them within the group timeout, and a group still running past it is
cancelled, never left in the engine."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.config import load_config
from asyncrl.generators.completion import Completion
from asyncrl.generators.schedulers.batch import BatchLoop


class LoopEngine:
    """The async engine's threading contract: ``submit`` runs a coroutine on a loop of its own."""

    version = 0

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def tokenize_prompts(self, prompts):
        return [{"prompt_token_ids": [ord(c) for c in p]} for p in prompts]

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


class Rollout:
    def __init__(self, n: int, hang: str | None = None):
        self.sampling = SimpleNamespace(n=n)
        self.hang, self.cancelled, self.running = hang, [], 0

    async def sample(self, key, row, prompt_ids, seed):
        self.running += 1
        try:
            if key == self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(0.01)
            ids = np.array([1, 2], dtype=np.int32)
            return [
                Completion(np.array(prompt_ids, np.int32), ids, np.zeros(2, np.float32), "ab", "stop")
                for _ in range(self.sampling.n)
            ]
        except asyncio.CancelledError:
            self.cancelled.append(key)
            raise


def loop_with(rollout, overrides=()):
    cfg = load_config("configs/bench_pipeline.yaml", ["generator.mode=batch", *overrides])
    engine = LoopEngine()
    gen = SimpleNamespace(cfg=cfg, engine=engine, ctx=SimpleNamespace(name="generator-0"))
    batch = BatchLoop.__new__(BatchLoop)
    batch.gen, batch.cfg, batch.rollout = gen, cfg, rollout
    return batch, engine


def rows(k: int) -> list[dict]:
    return [{"group_id": f"g{i}", "text": "1+1=", "prompt_uid": f"p{i}", "task": "t", "answer": "2"} for i in range(k)]


def test_a_batch_of_rollouts_waits_for_every_group():
    rollout = Rollout(n=3)
    batch, engine = loop_with(rollout)
    try:
        out = batch.sample_rollouts(rows(4), seeds=[1, 2, 3, 4])
    finally:
        engine.close()
    assert [len(group) for group in out] == [3, 3, 3, 3]
    assert out[0][0].prompt_ids.tolist() == [ord(c) for c in "1+1="]


def test_a_group_past_the_timeout_fails_the_batch_and_is_cancelled():
    rollout = Rollout(n=2, hang="g1")
    batch, engine = loop_with(rollout, ["generator.group_timeout_s=0.5"])
    try:
        with pytest.raises(TimeoutError, match="generator.group_timeout_s"):
            batch.sample_rollouts(rows(3), seeds=[1, 2, 3])
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), engine.loop).result(5)
    finally:
        engine.close()
    assert rollout.cancelled == ["g1"]
