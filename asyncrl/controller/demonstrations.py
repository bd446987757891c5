"""The warm start of a multi-turn run: the environment's demonstrations, as the generators' tokens.

A run with ``environment.cls`` and ``model.warm_start`` learns the dialogue before RL. For each
prompt of an SFT batch, an instance of the environment (built with ``environment.options``)
writes a demonstration, ``env.demonstration(row, rng)``: the episode's messages in order, the
model's turns (``{"role": "assistant", "content": ...}``) and the environment's answers to them.
What the demonstrations teach, and what they leave to RL, is the environment's to say.

A demonstration becomes tokens by being played through ``run_episode`` with the generator's own
pieces (``EpisodeGroups``: the renderer of ``environment.plain_template`` or the chat template,
the stop strings of the tool format, the end-of-turn ids, the limits): its model turns stand in
for the engine, one a request, and the environment answers them. The ids are therefore exactly
what a generator holds after sampling those turns, and the loss mask is the episode's own, 1 on
the model's turns and 0 on the environment's answers. A model turn is its text's tokens followed
by the eos token, unless it ends at a stop string (a tool call), where the engine stops without
one.

A demonstration the generators could not replay is a ValueError naming the prompt and the turn:
one the environment answers otherwise than written, one that goes on after the environment ended
it or stops before, a turn longer than ``sampling.max_tokens`` (or the room ``max_model_len``
leaves), or one written past a stop string. One longer than ``environment.max_turns`` is cut
there, as the generators cut an episode.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from asyncrl.config import RunConfig
from asyncrl.generators.completion import Completion
from asyncrl.generators.rollouts.episode_group import EpisodeGroups
from asyncrl.generators.rollouts.multi_turn import run_episode
from asyncrl.models.sft import TokenExample
from asyncrl.tasks.environments.base import Step
from asyncrl.tasks.prompts import Prompt

ASSISTANT = "assistant"


class Demonstrations:
    """Prompts -> ``TokenExample``s of the environment's demonstrations (see the module docstring),
    for ``run_sft(..., examples=Demonstrations(cfg, tokenizer, seed))``.

    ``tokenizer`` is the policy model's; ``seed`` seeds the one ``random.Random`` every
    demonstration draws from, in the order of the prompts.
    """

    def __init__(self, cfg: RunConfig, tokenizer, seed: int):
        if cfg.environment.cls is None:
            raise ValueError("demonstrations need an environment: environment.cls is null")
        # The generator's own episode pieces; the engine is only asked for its tokenizer here.
        self.groups = EpisodeGroups(
            SimpleNamespace(tokenizer=tokenizer), cfg.environment, cfg.sampling, cfg.engine.max_model_len
        )
        if not callable(getattr(self.groups.env_cls, "demonstration", None)):
            raise ValueError(
                f"model.warm_start with environment.cls ({cfg.environment.cls}) needs the class's "
                "demonstration(row, rng) method: the episodes the warm start learns"
            )
        self.tokenizer, self.max_tokens = tokenizer, cfg.sampling.max_tokens
        self.rng = random.Random(seed)

    def __call__(self, prompts: list[Prompt]) -> list[TokenExample]:
        return asyncio.run(self._examples(prompts))

    async def _examples(self, prompts: list[Prompt]) -> list[TokenExample]:
        return [await self.example(prompt) for prompt in prompts]  # in order: the draws stay seeded

    async def example(self, prompt: Prompt) -> TokenExample:
        """One demonstration of ``prompt``, played and checked (see the module docstring)."""
        row = prompt_row(prompt)
        env = self.groups.make_environment()
        messages = list(env.demonstration(row, self.rng))
        where = f"the demonstration of {prompt.prompt_uid}"
        turns = script(messages, where)
        prompt_ids = [int(t) for t in self.tokenizer.encode(prompt.text)]
        recorder = _Recorder(env)
        episode = await run_episode(
            self._scripted(turns, where),
            recorder,
            self.groups.renderer,
            row,
            prompt_ids,
            self.groups.limits(prompt_ids, self.max_tokens),
            self.groups.end_of_turn_ids,
        )
        if episode.env_error is not None:
            raise ValueError(f"{where}: the environment failed it ({episode.env_error})")
        for index, (step, (_, written)) in enumerate(zip(recorder.steps, turns)):
            if step.messages != written:
                raise ValueError(
                    f"{where}: after turn {index} the environment answers {step.messages!r}, the demonstration {written!r}"
                )
        played = len(recorder.steps)
        cut_at_max_turns = episode.finish_reason == "length" and played == self.groups.env_cfg.max_turns
        if played < len(turns) and not cut_at_max_turns:
            raise ValueError(
                f"{where}: the episode ended after turn {played - 1} ({episode.finish_reason}: the environment "
                f"ended it, or the next answer left no room), the demonstration has {len(turns)} turns"
            )
        return TokenExample(
            prompt_ids + episode.response_ids.tolist(), [0] * len(prompt_ids) + episode.loss_mask.tolist()
        )

    def _scripted(self, turns: list[tuple[str, list[dict]]], where: str):
        """``sample_turn`` for ``run_episode`` that answers the demonstration's turns in order."""
        stops = self.groups.stop
        eos = self.tokenizer.eos_token_id

        async def sample_turn(context: list[int], max_tokens: int, index: int) -> Completion:
            if index >= len(turns):
                raise ValueError(f"{where}: it ends after turn {index - 1}, and the environment asks for another")
            text = turns[index][0]
            ends_at_stop = any(text.endswith(s) for s in stops)
            early = [s for s in stops if s in text and not (ends_at_stop and text.index(s) == len(text) - len(s))]
            if early:
                raise ValueError(f"{where}: turn {index} ({text!r}) goes on past the stop string {early[0]!r}")
            ids = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
            if not ends_at_stop:
                ids.append(eos)  # the model ends its turn itself; at a stop string the engine ends it
            if len(ids) > max_tokens:
                raise ValueError(
                    f"{where}: turn {index} ({text!r}) is {len(ids)} tokens, the generators leave it {max_tokens} "
                    "(sampling.max_tokens, or what engine.max_model_len leaves the episode)"
                )
            return Completion(
                prompt_ids=np.asarray(context, dtype=np.int32),
                response_ids=np.asarray(ids, dtype=np.int32),
                logprobs=np.zeros(len(ids), dtype=np.float32),
                text=text,
                finish_reason="stop",
                version_segments=[[0, 0]],
            )

        return sample_turn


def prompt_row(prompt: Prompt) -> dict[str, Any]:
    """The row an environment is reset with, as the dispatcher hands it out (``PromptRow``)."""
    row = {"group_id": "demonstration", "prompt_uid": prompt.prompt_uid, "text": prompt.text}
    row.update(answer=prompt.answer, task=prompt.task)
    if prompt.columns is not None:
        row["columns"] = prompt.columns
    return row


def script(messages: list[dict], where: str) -> list[tuple[str, list[dict]]]:
    """A demonstration's messages as its turns: (the model's text, the messages answering it)."""
    if not messages or messages[0].get("role") != ASSISTANT:
        raise ValueError(
            f"{where}: it must start with a model turn ({{'role': 'assistant', ...}}), not {messages[:1]!r}"
        )
    turns: list[tuple[str, list[dict]]] = []
    for message in messages:
        if message.get("role") == ASSISTANT:
            turns.append((str(message["content"]), []))
        else:
            turns[-1][1].append(message)
    return turns


class _Recorder:
    """The environment, its steps kept: what it answered each turn."""

    def __init__(self, env):
        self.env, self.steps = env, []

    async def reset(self, row: dict) -> None:
        await self.env.reset(row)

    async def step(self, text: str) -> Step:
        step = await self.env.step(text)
        self.steps.append(step)
        return step

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            await close()


def load_demonstrations(cfg: RunConfig, model_dir: Path) -> Demonstrations:
    """The demonstrations of ``cfg``'s environment in the tokens of the model in ``model_dir``."""
    from asyncrl.tasks.formatting import load_tokenizer

    return Demonstrations(cfg, load_tokenizer(model_dir), cfg.sft.seed)
