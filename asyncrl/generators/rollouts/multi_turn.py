"""Multi-turn rollouts: a group of n episodes of one prompt, each a dialogue with its own environment.

An episode (``run_episode``) starts from the prompt and what the environment's ``reset``
answers (its opening messages, rendered into the prompt: nothing is sampled yet), then
alternates model turns and environment steps:

1. the model samples a turn after the prompt and everything so far, token in, token out: the
   context is the ids kept, never text tokenized again (``asyncrl.generators.rollouts.render``);
2. the environment answers the turn's text (``Environment.step``): a reward, messages, or done;
3. its messages are rendered to ids and appended, out of the loss (``EpisodeBuilder``).

It ends when the environment says done (finish reason ``stop``), or at a limit, finish reason
``length``: ``environment.max_turns`` turns, ``environment.max_episode_tokens`` tokens after the
prompt (an observation that would not leave room for one more token is not appended), a turn
cut at ``sampling.max_tokens`` or at the engine's ``max_model_len``.

An environment that raises, or takes longer than ``environment.step_timeout_s`` to reset, step or
close, ends its episode with ``env_error`` set: the ``environment`` reward leaves it unscored
with that reason (the group is dropped by it, counted), and the generator goes on. Nothing here
waits without a bound: each model turn is bounded by the generator's group timeout, which aborts
the whole group (``asyncrl.generators.schedulers.continuous``).

Each turn is its own engine request with its own seed (derived from the group's seed, the
episode's index and the turn), so a group replays under the same weights. A weight update
between two turns is recorded like one within a turn: the episode's ``version_segments`` say
which version sampled which model tokens, and its staleness is its oldest trained token's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.generators.completion import Completion
from asyncrl.generators.rollouts.episode import EpisodeBuilder
from asyncrl.generators.rollouts.render import Renderer
from asyncrl.tasks.environments.base import Environment, EnvironmentFailure

SampleTurn = Callable[[list[int], int, int], Awaitable[Completion]]
"""``sample_turn(context_ids, max_tokens, turn)``: one model turn after ``context_ids`` (n = 1)."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_turn_tokens: int
    """``sampling.max_tokens``: tokens one turn may sample."""
    max_episode_tokens: int
    """Tokens after the prompt the episode may hold (the model's and the environment's)."""
    step_timeout_s: float


async def run_episode(
    sample_turn: SampleTurn,
    env: Environment,
    renderer: Renderer,
    row: dict[str, Any],
    prompt_ids: list[int],
    limits: EpisodeLimits,
    end_of_turn_ids: set[int],
) -> Completion:
    """One episode of ``env`` after ``prompt_ids`` (see the module docstring)."""
    episode = EpisodeBuilder(prompt_ids)
    finish = "length"
    timeout = limits.step_timeout_s
    try:
        first = await _bounded(env.reset(row), timeout, "reset")
        if first:  # the environment's opening messages: part of the prompt, before the first turn
            episode = EpisodeBuilder(renderer.opening(prompt_ids, first))
        for turn in range(limits.max_turns):
            room = min(limits.max_turn_tokens, limits.max_episode_tokens - len(episode))
            if room < 1:
                break
            sampled = await sample_turn(episode.context(), room, turn)
            episode.add_turn(sampled)
            if sampled.finish_reason == "length":
                break  # cut mid-turn: the environment is not asked about half an answer
            step = await _bounded(env.step(sampled.text), timeout, "step")
            episode.add_step_reward(float(step.reward))
            episode.tool_calls += step.tool_calls
            episode.tool_errors += step.tool_errors
            if step.done:
                finish = "stop"
                break
            if turn + 1 == limits.max_turns:
                break  # no turn left to answer an observation
            closed = len(sampled.response_ids) > 0 and int(sampled.response_ids[-1]) in end_of_turn_ids
            observation = renderer.observation(step.messages, turn_closed=closed)
            if len(episode) + len(observation) >= limits.max_episode_tokens:
                break  # no room left for the model to answer it
            episode.add_observation(observation)
    except EnvironmentFailed as e:  # the environment's failure is the episode's, never the generator's
        episode.env_error = str(e)
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            try:
                await _bounded(close(), timeout, "close")
            except EnvironmentFailed as e:
                episode.env_error = episode.env_error or str(e)
    return episode.completion(finish)


class EnvironmentFailed(Exception):
    """The environment raised or overran ``environment.step_timeout_s``: its message is the
    episode's ``env_error`` (``environment_timeout: ...`` or ``environment_failed: ...``)."""


async def _bounded(awaitable, timeout_s: float, what: str):
    """An environment call, bounded; what it raises becomes ``EnvironmentFailed``. The model's
    own requests are not wrapped: an engine failure is the generator's, as for single turns."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise EnvironmentFailed(
            f"environment_timeout: its {what} took longer than {timeout_s:g} s (environment.step_timeout_s)"
        ) from None
    except asyncio.CancelledError:
        raise
    except EnvironmentFailure as e:  # it names its own kind
        raise EnvironmentFailed(str(e)) from e
    except Exception as e:
        raise EnvironmentFailed(f"environment_failed: {what} raised {type(e).__name__}: {e}") from e
