"""A group of n episodes of one prompt, on the generator's async vLLM engine.

``EpisodeGroups.sample(key, row, seed)`` is a coroutine for the engine's event loop
(``VLLMStream.submit_rollout``): n episodes run concurrently, each with its own environment
instance, and each model turn is one request of n = 1 (``AsyncVLLMEngine.sample_request``), so
vLLM batches the turns of every episode in flight like any other requests.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.generators.engine import Completion
from asyncrl.generators.rollouts.multi_turn import EpisodeLimits, run_episode
from asyncrl.generators.rollouts.render import build_renderer
from asyncrl.generators.sampling import derive_seed, sampling_params
from asyncrl.tasks.environments.base import ToolEnvironment, load_environment_class
from asyncrl.tasks.environments.tool_calls import stop_strings


class EpisodeGroups:
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

    async def sample(self, key: str, row: dict[str, Any], prompt_ids: list[int], seed: int) -> list[Completion]:
        """The group's n episodes, in order."""
        room = self.max_model_len - len(prompt_ids) - 1
        limits = EpisodeLimits(
            max_turns=self.env_cfg.max_turns,
            max_turn_tokens=self.sampling.max_tokens,
            max_episode_tokens=min(self.env_cfg.max_episode_tokens or room, room),
            step_timeout_s=self.env_cfg.step_timeout_s,
        )
        episodes = [
            run_episode(
                self._turns(key, index, seed),
                self.make_environment(),
                self.renderer,
                row,
                prompt_ids,
                limits,
                self.end_of_turn_ids,
            )
            for index in range(self.sampling.n)
        ]
        return list(await asyncio.gather(*episodes))

    def _turns(self, key: str, index: int, seed: int):
        from vllm.sampling_params import RequestOutputKind

        async def sample_turn(context: list[int], max_tokens: int, turn: int) -> Completion:
            one = self.sampling.model_copy(update={"n": 1, "max_tokens": max_tokens, "stop": list(self.stop)})
            if self.stop:
                one = one.model_copy(update={"include_stop_str_in_output": True})
            (params,) = sampling_params(
                one, 1, [derive_seed(seed, index * 1000 + turn)], output_kind=RequestOutputKind.FINAL_ONLY
            )
            return await self.engine.sample_request(context, params, f"{key}/{index}/t{turn}")

        return sample_turn
