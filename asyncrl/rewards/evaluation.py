"""Evaluation answers scored by the run's own rewards, in the controller.

Held-out answers are not samples (``asyncrl.tasks.heldout``): they never reach the reward workers.
So that "correct" in evaluation means what the reward means in training, the controller builds the
same reward objects (``build_reward``) and scores each answer with one of them: the reward
``eval.reward`` names among the task's rewards (``reward.by_task``, else ``reward.rewards``;
``eval.reward_by_task`` per task), or by default the task's first ``exact_match`` or
``math_verify`` reward, else its first ``python`` one, else (a judge or a reward model only) the
task's exact match. An answer is correct when that reward's
value is at least ``eval.correct_at`` (``asyncrl.tasks.eval_metrics``).

Only the kinds that run in-process are allowed: the rules and ``python`` (whose user code runs in
its own child processes with a timeout, as in a reward worker). The HTTP kinds and reward models
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

from asyncrl.rewards.registry import RewardSpec, build_reward
from asyncrl.rewards.unscored import Unscored
from asyncrl.wire.schema import Group, Sample

log = logging.getLogger(__name__)

IN_PROCESS = ("exact_match", "format", "math_verify", "python")
"""Reward kinds evaluation may score with (the module docstring says why not the others)."""
COMPARES_ANSWER = ("exact_match", "math_verify")
"""Kinds that compare with the reference answer: a prompt without one is not scored by them."""
CLOSE_S = 30.0
"""Seconds ``close`` gives the rewards (their child processes) to end."""


def eval_reward_spec(reward_cfg, eval_cfg, task: str) -> RewardSpec:
    """The reward that decides whether ``task``'s answers are correct (``reward_cfg``: the run's
    ``RewardConfig``; ``eval_cfg``: its ``EvalConfig``); a ValueError names what is wrong."""
    specs = reward_cfg.by_task.get(task, reward_cfg.rewards)
    labels = [s.label for s in specs]
    wanted = eval_cfg.reward_by_task.get(task, eval_cfg.reward)
    if wanted is not None:
        spec = next((s for s in specs if s.label == wanted), None)
        if spec is None:
            raise ValueError(f"eval.reward ({wanted!r}) must name one of task {task!r}'s rewards: {labels}")
    else:
        spec = next((s for s in specs if s.kind in COMPARES_ANSWER), None)
        spec = spec or next((s for s in specs if s.kind == "python"), None)
        # Rewards of other kinds only (a judge, a reward model): the task's exact match, as before.
        spec = spec or RewardSpec(kind="exact_match")
    if spec.kind not in IN_PROCESS:
        raise ValueError(
            f"eval.reward ({spec.label!r}) is of kind {spec.kind}: evaluation is scored in the controller "
            f"by the kinds {IN_PROCESS} only; name one of those"
        )
    return spec


def eval_reward_specs(cfg) -> dict[str, RewardSpec]:
    """Each task's evaluation reward (``cfg``: the run's ``RunConfig``), checked."""
    tasks = cfg.task.task_names()
    unknown = [name for name in cfg.eval.reward_by_task if name not in tasks]
    if unknown:
        raise ValueError(f"eval.reward_by_task {unknown} must name tasks of this run: {tasks}")
    return {task: eval_reward_spec(cfg.reward, cfg.eval, task) for task in tasks}


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

    def submit(self, prompts: list, answers: list[list[tuple[str, str]]]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._score(prompts, answers), self.loop)

    async def _score(self, prompts: list, answers: list[list[tuple[str, str]]]) -> list:
        return list(await asyncio.gather(*(self._prompt(p, a) for p, a in zip(prompts, answers))))

    async def _prompt(self, prompt, answers: list[tuple[str, str]]) -> list[float | None] | None:
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
