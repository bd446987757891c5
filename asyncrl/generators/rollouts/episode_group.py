"""A group of n episodes of one prompt, on the generator's async vLLM engine.

``EpisodeGroups.sample(key, row, prompt_ids, seed)`` is a coroutine for the engine's event loop
(``VLLMStream.submit_rollout``): n episodes run concurrently, each with its own environment
instance, and each model turn is one request of n = 1 (``AsyncVLLMEngine.sample_request``), so
vLLM batches the turns of every episode in flight like any other requests. ``evaluate`` plays
the held-out prompts of an evaluation request the same way, greedily and sampled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from asyncrl.generators.completion import Completion
from asyncrl.generators.interrupt import resumable_answer
from asyncrl.generators.rollouts.multi_turn import EpisodeLimits, run_episode
from asyncrl.generators.rollouts.render import build_renderer
from asyncrl.generators.sampling import derive_seed
from asyncrl.tasks.environments.base import ToolEnvironment, load_environment_class
from asyncrl.tasks.environments.tool_calls import stop_strings


class EpisodeGroups:  # a Rollout (asyncrl.generators.rollouts.base)
    """Episodes of the environment ``env_cfg.cls`` (an ``EnvironmentConfig``) sampled by
    ``engine`` (an ``AsyncVLLMEngine``) with ``sampling`` (a ``SamplingConfig``)."""

    def __init__(self, engine, env_cfg, sampling, max_model_len: int):
        self.engine, self.env_cfg, self.sampling = engine, env_cfg, sampling
        self.env_cls = load_environment_class(env_cfg.cls)
        tokenizer = engine.tokenizer
        self.renderer = build_renderer(tokenizer, env_cfg.plain_template)
        self.end_of_turn_ids = {tokenizer.eos_token_id} | set(sampling.stop_token_ids)
        self.max_model_len = max_model_len
        self.stop = list(sampling.stop)
        self.tool_format = None
        if issubclass(self.env_cls, ToolEnvironment):
            self.tool_format = env_cfg.tool_format or self.env_cls.tool_format
            if self.tool_format == "tag":  # a call ends the turn, so its result comes before the model goes on
                self.stop += stop_strings("tag", list(self.env_cls.tools()))

    def make_environment(self):
        env = self.env_cls(**self.env_cfg.options)
        if self.tool_format is not None:
            env.tool_format = self.tool_format
        return env

    def limits(self, prompt_ids: list[int], max_turn_tokens: int) -> EpisodeLimits:
        room = self.max_model_len - len(prompt_ids) - 1
        return EpisodeLimits(
            max_turns=self.env_cfg.max_turns,
            max_turn_tokens=max_turn_tokens,
            max_episode_tokens=min(self.env_cfg.max_episode_tokens or room, room),
            step_timeout_s=self.env_cfg.step_timeout_s,
        )

    def episode(self, key: str, row: dict[str, Any], prompt_ids: list[int], turn: TurnSampling, max_tokens: int):
        """One episode's coroutine (``run_episode``), its turns sampled as ``turn`` says."""
        return run_episode(
            self._turns(key, turn),
            self.make_environment(),
            self.renderer,
            row,
            prompt_ids,
            self.limits(prompt_ids, max_tokens),
            self.end_of_turn_ids,
        )

    async def sample(self, key: str, row: dict[str, Any], prompt_ids: list[int], seed: int) -> list[Completion]:
        """The group's n episodes, in order, sampled as ``sampling`` says (each turn seeded from
        ``seed``, the episode's index and the turn)."""
        s = self.sampling
        episodes = [
            self.episode(
                f"{key}/{i}", row, prompt_ids, TurnSampling(s.temperature, s.top_p, s.top_k, seed, i), s.max_tokens
            )
            for i in range(s.n)
        ]
        return list(await asyncio.gather(*episodes))

    async def evaluate(
        self, key: str, rows: list[dict[str, Any]], prompt_ids: list[list[int]], request
    ) -> list[list[Completion]]:
        """Held-out episodes for an ``EvalRequest``: per prompt, one greedy episode, then
        ``samples_k`` sampled ones (seeded by the request's seed of the prompt), in order."""
        per_prompt = []
        for index, (row, ids) in enumerate(zip(rows, prompt_ids)):
            turns = [TurnSampling(0.0, 1.0, 0, None, 0)]
            turns += [
                TurnSampling(request.temperature, request.top_p, 0, request.seeds[index], j)
                for j in range(request.samples_k)
            ]
            episodes = [
                self.episode(f"{key}/{index}/{j}", row, ids, turn, request.max_new_tokens)
                for j, turn in enumerate(turns)
            ]
            per_prompt.append(asyncio.gather(*episodes))
        return [list(done) for done in await asyncio.gather(*per_prompt)]

    def _turns(self, key: str, turn: TurnSampling):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling

        async def sample_turn(context: list[int], max_tokens: int, index: int) -> Completion:
            params = SamplingParams(
                n=1,
                temperature=turn.temperature,
                top_p=turn.top_p if turn.temperature > 0 else 1.0,
                top_k=turn.top_k,
                max_tokens=max_tokens,
                stop=self.stop or None,
                stop_token_ids=list(s.stop_token_ids) or None,
                include_stop_str_in_output=bool(self.stop) or s.include_stop_str_in_output,
                logprobs=0,  # the sampled token's: the behaviour logprob
                seed=None if turn.seed is None else derive_seed(turn.seed, turn.episode * 1000 + index),
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            # A turn aborted as too stale (generator.partial_rollouts: resume) goes on under the
            # weights loaded now, its tokens kept; nothing else aborts a turn.
            return await resumable_answer(self.engine, context, params, f"{key}/t{index}")

        return sample_turn


@dataclass(frozen=True)
class TurnSampling:
    """How an episode's turns are sampled: temperature 0 is greedy; each turn's seed is derived
    from ``seed`` (None: unseeded), the episode's index and the turn."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    episode: int
