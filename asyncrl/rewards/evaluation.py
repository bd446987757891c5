"""Evaluation answers scored by the run's own rewards, in the controller.

Held-out answers are not samples (``asyncrl.tasks.heldout``): they never reach the reward workers.
So that "correct" in evaluation means what the reward means in training, the controller builds the
same reward objects (``build_reward``) and scores each answer with one of them: the reward
``eval.reward`` names among the task's rewards (``reward.by_task``, else ``reward.rewards``;
``eval.reward_by_task`` per task), or by default the task's first ``exact_match`` or
``math_verify`` reward, else its first ``python`` one, else (a judge or a reward model only) the
task's exact match. An answer is correct when that reward's
value is at least ``eval.correct_at`` (``asyncrl.tasks.eval_metrics``).

Only the kinds that run in-process are allowed: the rules, ``python`` (whose user code runs in
its own child processes with a timeout, as in a reward worker) and ``environment`` (the reward
each held-out episode's environment gave it, sent back with the answers). The HTTP kinds and reward models
are refused for evaluation with a config error: they would need the reward workers' rate limits,
retries and breakers, or a model in the controller.

The rewards run on an event loop in a thread of their own (``EvalScorer``), so the controller's
event loop never waits for them: ``submit`` returns a future that the evaluator polls. Each
prompt is one group of its answers (greedy, then sampled), carrying its row's answer, columns and
task, as a training group would; a reward's ``Unscored`` result, non-finite value or exception
leaves that answer unscored (None), counted and taken as wrong. Evaluation answers carry text and
finish reason only: a reward that reads ``completion_ids`` gets an empty array.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading

import numpy as np

# The choice of each task's evaluation reward is config (``asyncrl.rewards.config``), checked when it is read.
from asyncrl.rewards.config import COMPARES_ANSWER, RewardSpec
from asyncrl.rewards.config import eval_reward_specs as eval_reward_specs  # re-exported
from asyncrl.rewards.registry import build_reward
from asyncrl.rewards.unscored import Unscored
from asyncrl.wire.schema import Episode, Group, Sample

log = logging.getLogger(__name__)

CLOSE_S = 30.0
"""Seconds ``close`` gives the rewards (their child processes) to end."""


def reward_value(result) -> float | None:
    """A reward's result as a number: a per-token array by its sum; None when unscored or not finite."""
    if isinstance(result, Unscored):
        return None
    value = float(np.asarray(result, dtype=np.float64).sum()) if isinstance(result, np.ndarray) else float(result)
    return value if math.isfinite(value) else None


class EvalScorer:
    """Scores evaluation answers with each task's evaluation reward, on its own thread's loop.

    ``submit(prompts, answers)``: ``answers[i]`` is prompt i's list of (text, finish reason);
    returns a ``concurrent.futures.Future`` of one entry per prompt: its answers' values (None:
    unscored), or None when its reward needs a reference answer it lacks.
    """

    def __init__(self, specs: dict[str, RewardSpec], task_metadata: dict[str, dict] | None = None):
        built: dict[int, object] = {}  # one reward object per spec, shared by the tasks that use it
        self.specs = specs
        self.rewards = {
            task: built.setdefault(id(spec), build_reward(spec, task_metadata)) for task, spec in specs.items()
        }
        self.failures = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="eval-scorer", daemon=True)
        self.thread.start()

    @property
    def labels(self) -> dict[str, str]:
        """Each task's evaluation reward by its name (``evals.jsonl``'s ``rewards``)."""
        return {task: spec.label for task, spec in self.specs.items()}

    def submit(
        self, prompts: list, answers: list[list[tuple[str, str]]], played: list[list[tuple]] | None = None
    ) -> concurrent.futures.Future:
        """``played``: with an environment, each answer's (environment reward, environment error),
        which the ``environment`` reward reads."""
        return asyncio.run_coroutine_threadsafe(self._score(prompts, answers, played), self.loop)

    async def _score(self, prompts: list, answers: list[list[tuple[str, str]]], played=None) -> list:
        played = played or [None] * len(prompts)
        return list(await asyncio.gather(*(self._prompt(p, a, e) for p, a, e in zip(prompts, answers, played))))

    async def _prompt(self, prompt, answers: list[tuple[str, str]], played=None) -> list[float | None] | None:
        spec, reward = self.specs[prompt.task], self.rewards[prompt.task]
        if spec.kind in COMPARES_ANSWER and not prompt.answer:
            return None
        group_id = f"eval/{prompt.prompt_uid}"
        empty_ids, empty_logprobs = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
        group = Group(
            group_id=group_id,
            prompt_uid=prompt.prompt_uid,
            task=prompt.task,
            prompt=prompt.text,
            answer=prompt.answer,
            prompt_ids=empty_ids,
            policy_version=0,
            generator="eval",
            samples=[
                Sample(f"{group_id}/{i}", empty_ids, empty_logprobs, text, finish)
                for i, (text, finish) in enumerate(answers)
            ],
            columns=prompt.columns,
        )
        for sample, (env_reward, env_error) in zip(group.samples, played or ()):
            sample.episode = Episode(f"{sample.uid}", np.zeros(0, np.uint8), env_reward=env_reward, env_error=env_error)
        try:
            results = list(await reward.score(group))
            if len(results) != len(answers):
                raise ValueError(f"{reward.name} gave {len(results)} results for {len(answers)} answers")
        except Exception as e:  # a reward's bug fails these answers, not the round: counted and logged once
            self.failures += 1
            if self.failures == 1:
                log.warning("eval reward %s failed on %s: %s: %s", spec.label, prompt.prompt_uid, type(e).__name__, e)
            return [None] * len(answers)
        return [reward_value(r) for r in results]

    def close(self) -> None:
        """Close the rewards (their child processes) and stop the loop, each bounded by ``CLOSE_S``."""
        if not self.thread.is_alive():
            return
        rewards = list({id(r): r for r in self.rewards.values()}.values())
        future = asyncio.run_coroutine_threadsafe(_close_all(rewards), self.loop)
        try:
            future.result(CLOSE_S)
        except Exception as e:  # closing is best effort (a timeout included): say so
            log.warning("eval rewards did not close within %.0f s: %s", CLOSE_S, e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_S)


async def _close_all(rewards: list) -> None:
    await asyncio.gather(*(r.close() for r in rewards))
