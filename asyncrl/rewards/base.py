"""The one interface of a reward, and how several rewards combine into a sample's reward.

A reward scores a whole group at once (a judge or reward model batches, a rule loops) and gives
one result per sample, in order:

- a ``float``: the sample's scalar reward;
- a ``np.ndarray`` of shape (T,): per-token rewards over ``response_ids`` (their sum enters the
  scalar reward, the array travels in ``Sample.token_rewards``);
- ``TeacherLogprobs(values)``: a teacher's (T,) log-probabilities of ``response_ids``
  (``asyncrl.rewards.teacher``): not a reward, they travel in ``Sample.teacher_logprobs`` for
  on-policy distillation; the scalar reward is untouched (the weight is not applied), and
  ``reward_parts`` records their mean of log pi_teacher - log mu over the policy's tokens;
- ``Unscored(reason)``: the reward could not score this sample (timeout, HTTP 429 after retries,
  unparsable judge output...). Never a 0 by accident: an unscored sample has ``reward = None``
  and its group carries ``unscored_reason``, so the buffer drops it by that reason.

Every reward declares the range of its scalar results, ``score_range = (low, high)`` (the rules
[0, 1], a JSON scorer its [min_score, max_score], [0, 1] unless widened, a judge the scale of its
template divided by its top); a result outside it leaves the sample ``Unscored("score_out_of_range")``,
never a 1e9 in training. A reward without one (a reward model's logits) is unbounded.

Rewards are async (``async def score(group)``); a synchronous scorer subclasses ``SyncReward``
and runs in a thread, so it does not stall the worker's other requests.

Combination (``combine``): with rewards i = 1..K and weights w_i, a sample scored by all of them
gets ``reward = Σ_i w_i · r_i`` where r_i is the scalar, or the sum of the per-token array;
``token_rewards = Σ_i w_i · t_i`` over the rewards that gave arrays. If any reward left a sample
unscored, the sample stays unscored (a partial sum is not the reward the config asked for), and
so does its group, since the buffer stores groups atomically.

Every sample records which rewards scored it and what they gave (``Sample.reward_parts``) and how
long each took (``Sample.reward_seconds``); ``Group.meta['rewards']`` lists the reward names.

Scoring a group again (a reward worker's requeue of an unscored group) need not buy good answers
twice: ``score_with(group, rewards, known)`` keeps each reward's successful results in ``known``,
and asks a reward that scores samples independently (``per_sample = True``: the HTTP rewards,
one request per sample) only for the samples it has not scored yet. Other rewards score the whole
group again, since their results may depend on the group as a whole.

The kinds of reward (``rules``, ``judge``, ``model``, ``function``) implement this interface; which kinds exist
and how a config entry builds one is ``asyncrl.rewards.registry``, so this module imports none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Protocol

import numpy as np

from asyncrl.observability.metrics import REWARD_LATENCY, REWARD_UNSCORED
from asyncrl.rewards.unscored import Unscored
from asyncrl.wire.schema import Group, Sample, loss_mask


@dataclasses.dataclass(frozen=True)
class TeacherLogprobs:
    """A teacher's log-probabilities of a sample's ``response_ids``, (T,) float32: the result of the
    ``teacher`` kind, written into ``Sample.teacher_logprobs`` by ``combine`` (not into the reward)."""

    values: np.ndarray


RewardResult = float | np.ndarray | TeacherLogprobs | Unscored


class TimedResults(list):
    """Results with the seconds each sample took, for rewards that score samples one by one (an
    HTTP judge); other rewards return a plain list and each sample records the group call's time."""

    def __init__(self, results: list[RewardResult], seconds: list[float]):
        super().__init__(results)
        self.seconds = list(seconds)


class Reward(Protocol):
    """Scores groups. ``name`` labels metrics and ``Sample.reward_parts``. A reward whose result
    for a sample does not depend on the others may set ``per_sample = True``: scored again, it is
    given only the samples still unscored (see ``score_with``)."""

    name: str

    async def score(self, group: Group) -> list[RewardResult]:
        """One result per sample of ``group``, in order. Should not raise; if it does, every
        sample of the group is unscored with reason ``error: ExceptionType``."""
        ...

    async def close(self) -> None: ...


class SyncReward:
    """Base of synchronous rewards: implement ``score_sync``; ``score`` runs it in a thread."""

    name = "sync"

    def score_sync(self, group: Group) -> list[RewardResult]:
        raise NotImplementedError

    async def score(self, group: Group) -> list[RewardResult]:
        return await asyncio.to_thread(self.score_sync, group)

    async def close(self) -> None:
        pass


Known = dict[str, dict[int, tuple[RewardResult, float]]]
"""Results a group already has, kept across scorings: reward name -> sample index -> (result, seconds)."""


async def score_with(group: Group, rewards: list[tuple[Reward, float]], known: Known | None = None) -> Group:
    """Run every reward on ``group`` concurrently, then ``combine`` into the samples (in place).

    ``known``: the results of an earlier scoring of this group (empty the first time); a reward
    with ``per_sample = True`` is asked only for the samples missing from it. The successful
    results of this call are added to it.
    """
    start = time.perf_counter()
    known = {} if known is None else known
    outcomes = await asyncio.gather(*(_score_missing(reward, group, known) for reward, _w in rewards))
    # (name, weight, results, seconds): per-sample seconds where the reward measured them
    combine(
        group,
        [(reward.name, weight, results, seconds) for (reward, weight), (results, seconds) in zip(rewards, outcomes)],
    )
    group.reward_s = time.perf_counter() - start
    return group


async def _score_missing(reward: Reward, group: Group, known: Known) -> tuple[list[RewardResult], list[float]]:
    """``reward``'s results for every sample of ``group``: those in ``known`` kept (per-sample rewards),
    the others scored now; the successful ones are added to ``known``."""
    have = known.setdefault(reward.name, {}) if getattr(reward, "per_sample", False) else {}
    missing = [i for i in range(len(group.samples)) if i not in have]
    results: list[RewardResult] = [have[i][0] if i in have else None for i in range(len(group.samples))]
    seconds = [have[i][1] if i in have else 0.0 for i in range(len(group.samples))]
    if missing:
        part = group if len(missing) == len(group.samples) else _subgroup(group, missing)
        scored, took = await _timed(reward, part)
        for j, i in enumerate(missing):
            results[i] = scored[j]
            seconds[i] = float(took[j] if isinstance(took, list) else took)
    if getattr(reward, "per_sample", False):
        for i in missing:
            if not isinstance(results[i], Unscored):
                have[i] = (results[i], seconds[i])
    return results, seconds


def _subgroup(group: Group, indices: list[int]) -> Group:
    """The group with only the samples at ``indices`` (the same sample objects)."""
    return dataclasses.replace(group, samples=[group.samples[i] for i in indices])


async def score_greedy_baseline(group: Group, rewards: list[tuple[Reward, float]]) -> None:
    """Score ``group.greedy_text`` (ReMax's baseline answer) with the same rewards, into
    ``group.greedy_reward``; if it cannot be scored the group is unscored with that reason
    (its samples' advantages would have no baseline)."""
    answer = Sample(
        uid=f"{group.group_id}/greedy",
        response_ids=np.zeros(0, dtype=np.int32),
        logprobs=np.zeros(0, dtype=np.float32),
        text=group.greedy_text,
        finish_reason="stop",
    )
    twin = dataclasses.replace(group, samples=[answer], meta={}, greedy_text=None, unscored_reason=None)
    await score_with(twin, rewards)
    if twin.scored:
        group.greedy_reward = float(answer.reward)
        return
    for sample in group.samples:
        sample.reward = None
    group.unscored_reason = f"{twin.unscored_reason or 'reward_failed'} (greedy baseline)"


async def _timed(reward: Reward, group: Group) -> tuple[list[RewardResult], float | list[float]]:
    start = time.perf_counter()
    per_sample = None
    try:
        results = await reward.score(group)
        per_sample = getattr(results, "seconds", None)
        results = list(results)
        if len(results) != len(group.samples):
            raise ValueError(f"{reward.name} gave {len(results)} results for {len(group.samples)} samples")
    except Exception as e:  # a scorer bug must not kill the worker: the samples are unscored by reason
        results = [Unscored(f"error: {type(e).__name__}", str(e)[:200])] * len(group.samples)
    results = [out_of_range(reward, r) or r for r in results]
    seconds = time.perf_counter() - start
    REWARD_LATENCY.labels(reward.name).observe(seconds)
    for r in results:
        if isinstance(r, Unscored):
            REWARD_UNSCORED.labels(reward.name, r.reason.split(":")[0]).inc()
    if per_sample is not None and len(per_sample) == len(results):
        return results, per_sample
    return results, seconds


def out_of_range(reward: Reward, result: RewardResult) -> Unscored | None:
    """``Unscored("score_out_of_range")`` for a scalar result outside the reward's declared
    ``score_range`` (low, high), None otherwise (a reward declaring none, or None, is unbounded)."""
    low, high = getattr(reward, "score_range", None) or (-np.inf, np.inf)
    if isinstance(result, (Unscored, np.ndarray, TeacherLogprobs)) or low <= result <= high or result != result:
        return None  # NaN is combine's to refuse (nonfinite_reward)
    return Unscored("score_out_of_range", f"{result} not in [{low}, {high}] (the reward's range)")


def combine(group: Group, parts: list[tuple[str, float, list[RewardResult], float | list[float]]]) -> None:
    """Write ``reward = Σ w_i r_i`` (and token rewards) into each sample of ``group``.

    ``parts`` holds (name, weight, per-sample results, seconds: one for the group or one per sample)
    for each reward. Samples any reward
    left unscored keep ``reward = None``; the group then gets ``unscored_reason``
    (``reward_failed: {name}: {reason}`` of the first such sample) and ``unscored_detail``.
    """
    group.meta["rewards"] = ",".join(name for name, *_ in parts)
    first_failure = None
    for index, sample in enumerate(group.samples):
        total, tokens, failed = 0.0, None, False
        sample.teacher_logprobs = None
        for name, weight, results, seconds in parts:
            result = results[index]
            sample.reward_seconds[name] = float(seconds[index] if isinstance(seconds, list) else seconds)
            if isinstance(result, Unscored):
                failed = True
                if first_failure is None:
                    first_failure = (name, result)
                continue
            if isinstance(result, TeacherLogprobs):
                unscored = attach_teacher(sample, result)
                if unscored is not None:
                    failed = True
                    first_failure = first_failure or (name, unscored)
                else:
                    sample.reward_parts[name] = teacher_margin(sample)
                continue
            if isinstance(result, np.ndarray):
                values = np.asarray(result, dtype=np.float32)
                if values.shape != sample.response_ids.shape:
                    failed = True
                    first_failure = first_failure or (name, Unscored("bad_token_rewards", f"shape {values.shape}"))
                    continue
                tokens = weight * values if tokens is None else tokens + weight * values
                value = float(values.sum())
            else:
                value = float(result)
            if not np.isfinite(value):
                failed = True
                first_failure = first_failure or (name, Unscored("nonfinite_reward", repr(value)))
                continue
            sample.reward_parts[name] = value
            total += weight * value
        sample.reward = None if failed else total
        sample.token_rewards = None if failed or tokens is None else tokens.astype(np.float32)
    if first_failure is not None:
        name, unscored = first_failure
        for sample in group.samples:  # the buffer keeps groups whole: a partly scored group is unscored
            sample.reward = None
            sample.token_rewards = None
            sample.teacher_logprobs = None
        group.unscored_reason = f"reward_failed: {name}: {unscored.reason}"
        group.unscored_detail = unscored.detail[:200]
    else:
        group.unscored_reason = group.unscored_detail = None


def attach_teacher(sample: Sample, result: TeacherLogprobs) -> Unscored | None:
    """Write a teacher's log-probabilities into ``sample.teacher_logprobs`` (0 on tokens out of
    the loss, as the behaviour logprobs); an ``Unscored`` when they do not fit the sample."""
    values = np.asarray(result.values, dtype=np.float32)
    if values.shape != sample.response_ids.shape:
        return Unscored("bad_teacher_logprobs", f"shape {values.shape}, the answer has {sample.response_ids.shape}")
    if not np.isfinite(values).all() or (values > 1e-4).any():
        return Unscored("bad_teacher_logprobs", "not finite, or > 0")
    values = np.minimum(values, 0.0)
    mask = loss_mask(sample)
    sample.teacher_logprobs = values if mask is None else np.where(mask != 0, values, 0.0).astype(np.float32)
    return None


def teacher_margin(sample: Sample) -> float:
    """Mean over the policy's tokens of log pi_teacher(y_t) - log mu(y_t): minus the per-token
    reverse KL estimate of the distillation (``asyncrl.learner.distill``), 0 for an empty answer."""
    mask = loss_mask(sample)
    keep = np.ones(len(sample.response_ids), bool) if mask is None else mask != 0
    if not keep.any():
        return 0.0
    return float((sample.teacher_logprobs[keep] - sample.logprobs[keep]).mean())
