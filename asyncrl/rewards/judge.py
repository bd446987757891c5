"""Rewards behind an HTTP API: a generic JSON scorer and an OpenAI-compatible LLM judge.

Both send one request per sample (all samples of a group concurrently, within the client's
limits; see ``asyncrl.rewards.http``), with the sample's uid as the idempotency key, and turn
every failure into ``Unscored(kind)`` — a judge that answers garbage gives ``unparsable_score``,
never a 0.

* ``JsonScorerReward`` POSTs ``{"uid", "task", "prompt", "response", "answer"}`` and reads the number
  at ``score_field`` of the reply (``{"score": 0.7}``).
* ``OpenAIJudgeReward`` POSTs a chat-completions request (or a completions one, for servers whose
  model has no chat template) whose user message is ``prompt_template`` filled with
  ``{prompt}``, ``{response}`` and ``{answer}``, then takes the first match of ``score_pattern``
  in the reply's text, checked against [min_score, max_score], divided by ``max_score``.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any, Literal

from pydantic import Field

from asyncrl.rewards.base import RewardResult, TimedResults, Unscored
from asyncrl.rewards.http import CallFailed, HttpClient, HttpConfig
from asyncrl.wire.schema import Group, Sample

DEFAULT_TEMPLATE = (
    "Rate the answer to the question from 0 to 10. Reply with the number only.\n"
    "Question: {prompt}\nReference: {answer}\nAnswer: {response}\nScore:"
)


class JsonScorerConfig(HttpConfig):
    """A generic JSON scoring endpoint."""

    score_field: str = "score"
    """Key of the number in the reply's JSON object."""


class JudgeConfig(HttpConfig):
    """An OpenAI-compatible judge (``/v1/chat/completions`` or ``/v1/completions`` at ``url``)."""

    model: str = "judge"
    """Model name sent in the request."""
    endpoint: Literal["chat", "completions"] = "chat"
    """Request shape: chat (messages) or completions (a prompt string)."""
    prompt_template: str = DEFAULT_TEMPLATE
    """The judge's prompt; ``{prompt}``, ``{response}`` and ``{answer}`` are filled in."""
    score_pattern: str = r"-?\d+(?:\.\d+)?"
    """Regex whose first match in the judge's reply is the score."""
    min_score: float = 0.0
    """Smallest valid score; outside [min_score, max_score] the sample is unscored."""
    max_score: float = Field(10.0, gt=0)
    """Largest valid score; the reward is score / max_score."""
    max_tokens: int = Field(8, ge=1)
    """Tokens the judge may write."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """More request fields, e.g. vLLM's ``{min_tokens: 1}`` or ``{seed: 0}``."""


class _HttpReward:
    def __init__(self, name: str, cfg: HttpConfig):
        self.name = name
        self.cfg = cfg
        self.client = HttpClient(name, cfg)

    async def score(self, group: Group) -> TimedResults:
        timed = await asyncio.gather(*(self._score_sample(group, s) for s in group.samples))
        return TimedResults([r for r, _ in timed], [t for _, t in timed])

    async def _score_sample(self, group: Group, sample: Sample) -> tuple[RewardResult, float]:
        start = time.perf_counter()
        try:
            result = await self.score_one(group, sample)
        except CallFailed as e:
            result = Unscored(e.kind, e.detail)
        return result, time.perf_counter() - start

    async def score_one(self, group: Group, sample: Sample) -> RewardResult:
        raise NotImplementedError

    async def close(self) -> None:
        await self.client.close()


class JsonScorerReward(_HttpReward):
    """One POST per sample to a JSON scorer; the reply's ``score_field`` is the reward."""

    cfg: JsonScorerConfig

    async def score_one(self, group: Group, sample: Sample) -> RewardResult:
        body = {
            "uid": sample.uid,
            "task": group.task,
            "prompt": group.prompt,
            "response": sample.text,
            "answer": group.answer,
        }
        reply = await self.client.post_json(body, idempotency_key=sample.uid)
        value = reply.get(self.cfg.score_field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Unscored("bad_score", f"{self.cfg.score_field}={value!r}"[:200])
        return float(value)


class OpenAIJudgeReward(_HttpReward):
    """An LLM judge behind an OpenAI-compatible API; see the module docstring."""

    cfg: JudgeConfig

    def __init__(self, name: str, cfg: JudgeConfig):
        super().__init__(name, cfg)
        self.pattern = re.compile(cfg.score_pattern)

    def request_body(self, group: Group, sample: Sample) -> dict:
        text = self.cfg.prompt_template.format(prompt=group.prompt, response=sample.text, answer=group.answer)
        body = {"model": self.cfg.model, "max_tokens": self.cfg.max_tokens, "temperature": 0.0, **self.cfg.extra_body}
        if self.cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    def parse_score(self, reply: dict) -> RewardResult:
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] if self.cfg.endpoint == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError):
            return Unscored("bad_reply", str(reply)[:200])
        match = self.pattern.search(text or "")
        if match is None:
            return Unscored("unparsable_score", repr(text)[:200])
        score = float(match.group())
        if not (self.cfg.min_score <= score <= self.cfg.max_score):
            return Unscored("score_out_of_range", f"{score} not in [{self.cfg.min_score}, {self.cfg.max_score}]")
        return score / self.cfg.max_score

    async def score_one(self, group: Group, sample: Sample) -> RewardResult:
        body = self.request_body(group, sample)
        text = body.get("prompt") or body["messages"][0]["content"]
        tokens = len(text) / 4 + self.cfg.max_tokens  # a rough count for the tokens-per-minute bucket
        reply = await self.client.post_json(body, idempotency_key=sample.uid, tokens=tokens)
        return self.parse_score(reply)
