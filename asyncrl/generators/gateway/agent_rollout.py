"""A group of n episodes of one prompt, each played by an agent program through the gateway.

``AgentGroups`` is a rollout (``asyncrl.generators.rollouts.base.Rollout``: ``.sampling``,
``sample``; and ``evaluate`` as ``EpisodeGroups``), driven on the engine's event loop. Per episode it opens an episode
in the ``Gateway`` and starts ``agent.command`` as a subprocess, in its own process group, with:

- ``OPENAI_BASE_URL`` (the episode's ``.../v1``), ``OPENAI_API_KEY`` (its bearer token),
  ``ASYNCRL_EPISODE_ID`` and ``ASYNCRL_REWARD_URL`` in its environment;
- the task on stdin, one JSON object: ``{"prompt": row text, "columns": the row's columns,
  "answer": the row's answer}``.

The episode ends at the first of:

- the program posts its reward: ``env_reward`` is it (the program is then given
  ``EXIT_GRACE_S`` to exit);
- the program exits 0 without a reward: the run's reward functions score its last answer
  (``env_reward`` None, no error);
- the program exits non-zero without a reward: unscored, ``agent_failed: exit code N: <stderr tail>``;
- ``agent.episode_timeout_s`` passes: unscored, ``agent_timeout: ...``.

An episode that made no model call is unscored too (``agent_made_no_call``): there is nothing to
train, and never a silent 0. Whatever ends it, the program's whole process group is killed and
awaited, and the gateway refuses the episode's later calls (409), so no process and no engine
request outlives its episode. The episode's samples (one per part, ``recorder``) all carry its
``env_reward`` and ``env_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
from typing import Any

from asyncrl.generators.completion import Completion
from asyncrl.generators.gateway.recorder import EpisodeRecorder
from asyncrl.generators.gateway.server import Gateway
from asyncrl.generators.gateway.session import AgentEpisode, turn_params
from asyncrl.generators.rollouts.episode import EpisodeBuilder
from asyncrl.generators.rollouts.render import ChatRenderer

log = logging.getLogger(__name__)

EXIT_GRACE_S = 5.0
"""Seconds a program that posted its reward is given to exit before its process group is killed."""
STDERR_TAIL = 2000
"""Characters of a failed program's stderr kept in its ``env_error``."""


class AgentGroups:
    """Episodes of the agent program ``agent_cfg.command`` (an ``AgentConfig``) sampled by
    ``engine`` (an ``AsyncVLLMEngine``, or any object with its ``tokenizer`` and
    ``sample_request``) under ``sampling`` (a ``SamplingConfig``).

    ``gateway``: a ``Gateway`` to serve the episodes; None: one of its own, bound as
    ``agent_cfg`` says and started on the engine's loop by the first ``sample`` (``close`` stops
    it). ``params``: builds one call's sampling parameters (vLLM's by default)."""

    def __init__(self, engine, agent_cfg, sampling, max_model_len: int, gateway=None, params=turn_params):
        if not agent_cfg.command:
            raise ValueError("agent.command (None) must name the agent program to run")
        if shutil.which(agent_cfg.command[0]) is None:
            raise ValueError(f"agent.command[0] ({agent_cfg.command[0]!r}) is not an executable program here")
        self.engine, self.cfg, self.sampling = engine, agent_cfg, sampling
        self.max_model_len, self.params = max_model_len, params
        self.gateway = gateway or Gateway(agent_cfg.host, agent_cfg.port, agent_cfg.max_request_bytes)
        self._own_gateway = gateway is None
        self._started: asyncio.Task | None = None
        tokenizer = engine.tokenizer
        self.renderer = ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        self.end_of_turn_ids = {tokenizer.eos_token_id} | set(sampling.stop_token_ids)
        self.counts = {"episodes": 0, "ignored_sampling": 0, "timeouts": 0, "failures": 0, "no_call": 0}
        """Episodes played; of those, ones whose requests asked for sampling settings that were
        ignored, that timed out, whose program failed, that made no call."""

    async def start(self) -> None:
        """Start the gateway this object owns, once (on the engine's loop); later calls return at once."""
        if not self._own_gateway:
            return
        if self._started is None:
            self._started = asyncio.ensure_future(self.gateway.start())
        await asyncio.shield(self._started)

    async def close(self) -> None:
        """Stop the gateway this object owns (its open episodes end)."""
        if self._own_gateway and self._started is not None:
            await self.gateway.close()

    async def sample(self, key: str, row: dict[str, Any], prompt_ids: list[int], seed: int) -> list[Completion]:
        """The group's n episodes' samples, flat, in episode order (each episode's parts in order)."""
        episodes = [self.episode(f"{key}/{i}", row, prompt_ids, seed, i) for i in range(self.sampling.n)]
        return [c for parts in await _all(episodes) for c in parts]

    async def evaluate(
        self, key: str, rows: list[dict[str, Any]], prompt_ids: list[list[int]], request
    ) -> list[list[Completion]]:
        """Held-out episodes for an ``EvalRequest``, as ``EpisodeGroups.evaluate``: per prompt, one
        greedy episode, then ``samples_k`` sampled with the request's temperature and top_p (seeded
        by the request's seed of the prompt), each episode's last part (the answer scored). Nothing
        here is trained, so the calls follow the request rather than the run's sampling."""
        per_prompt = []
        for index, (row, ids) in enumerate(zip(rows, prompt_ids)):
            settings = [(0.0, 1.0, None)]
            if request.samples_k:  # (a request without samples may carry no seeds)
                settings += [(request.temperature, request.top_p, request.seeds[index])] * request.samples_k
            episodes = []
            for j, (temperature, top_p, seed) in enumerate(settings):
                update = {
                    "n": 1,
                    "temperature": temperature,
                    "top_p": top_p,
                    "top_k": 0,
                    "max_tokens": request.max_new_tokens,
                }
                sampling = self.sampling.model_copy(update=update)  # unvalidated: temperature 0 is greedy here
                episodes.append(self.episode(f"{key}/{index}/{j}", row, ids, seed, j, sampling))
            per_prompt.append(_all(episodes))
        return [[parts[-1] for parts in done] for done in await _all(per_prompt)]

    async def episode(
        self, name: str, row: dict[str, Any], prompt_ids: list[int], seed: int | None, index: int, sampling=None
    ) -> list[Completion]:
        """One episode (see the module docstring): its parts, never empty. ``sampling``: the
        calls' settings (None: the run's)."""
        await self.start()
        recorder = EpisodeRecorder(self.engine.tokenizer, self.renderer, self.end_of_turn_ids)
        episode = AgentEpisode(
            name,
            self.engine,
            recorder,
            sampling or self.sampling,
            self.max_model_len,
            self.cfg.max_calls,
            seed,
            index,
            self.params,
        )
        episode_id = self.gateway.open(episode)
        error: str | None = None
        try:
            error = await self._play(episode_id, episode, row)
        finally:
            await self.gateway.end(episode_id)
        if episode.failure is not None:
            raise RuntimeError(f"agent episode {name}: the engine failed") from episode.failure
        self.counts["episodes"] += 1
        self.counts["ignored_sampling"] += bool(episode.ignored)
        parts = recorder.completions(index)
        if not parts and error is None:
            error = "agent_made_no_call: the program ended without a model call"
            self.counts["no_call"] += 1
        if not parts:  # one empty, unscored sample keeps the group at n episodes
            parts = EpisodeBuilder(prompt_ids).completion("stop")
            parts.episode_index, parts.turns = index, 0
            parts = [parts]
        for part in parts:
            part.env_reward = None if error is not None else episode.reward
            part.env_error = error
        return parts

    async def _play(self, episode_id: str, episode: AgentEpisode, row: dict[str, Any]) -> str | None:
        """Run the program until the episode ends; returns its ``env_error`` (None: it ended well)."""
        env = dict(
            os.environ,
            OPENAI_BASE_URL=self.gateway.base_url(episode_id),
            OPENAI_API_KEY=episode.token,
            ASYNCRL_EPISODE_ID=episode_id,
            ASYNCRL_REWARD_URL=self.gateway.reward_url(episode_id),
        )
        task = {"prompt": row.get("text"), "columns": row.get("columns", {}), "answer": row.get("answer")}
        process = await asyncio.create_subprocess_exec(
            *self.cfg.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, killed whole at the end
        )
        stderr = asyncio.ensure_future(_tail(process.stderr))
        timeout = self.cfg.episode_timeout_s
        try:
            await asyncio.wait_for(
                _until_exit_or_reward(process, episode, json.dumps(task, default=str).encode()), timeout
            )
        except asyncio.TimeoutError:
            self.counts["timeouts"] += 1
            return f"agent_timeout: the program ran longer than {timeout:g} s (agent.episode_timeout_s)"
        finally:
            await self.gateway.end(episode_id)  # no call is taken from here on
            if process.returncode is None and episode.reward is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(process.wait(), EXIT_GRACE_S)
            await _kill_group(process)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stderr, EXIT_GRACE_S)
            stderr.cancel()
        if episode.reward is not None:
            return None
        if process.returncode != 0:
            self.counts["failures"] += 1
            tail = stderr.result() if stderr.done() and not stderr.cancelled() else ""
            return f"agent_failed: exit code {process.returncode}: {tail}"
        return None


async def _until_exit_or_reward(process: asyncio.subprocess.Process, episode: AgentEpisode, task: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a program that reads no stdin
        process.stdin.write(task + b"\n")
        await process.stdin.drain()
        process.stdin.close()
    exited = asyncio.ensure_future(process.wait())
    rewarded = asyncio.ensure_future(episode.rewarded.wait())
    try:
        await asyncio.wait({exited, rewarded}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        rewarded.cancel()
        exited.cancel()


async def _all(coroutines: list) -> list:
    """Every result, in order; when one raises, the others are cancelled (and their programs killed)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _tail(stream: asyncio.StreamReader) -> str:
    """The last ``STDERR_TAIL`` characters of ``stream``, read to its end (so the pipe never fills)."""
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-STDERR_TAIL:]
    return kept.decode(errors="replace").strip()


async def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the program's process group (its children included) and reap the program."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()
