"""Rewards behind an HTTP API: a generic JSON scorer and an OpenAI-compatible LLM judge.

Both send one request per sample (all samples of a group concurrently, within the client's
limits; see ``asyncrl.rewards.http``), with the reward's name and the sample's uid as the
idempotency key, and turn every failure of a sample into ``Unscored(kind)`` — a judge that
answers garbage gives ``unparsable_score``, never a 0 — so one sample's failure never costs its
siblings their scores, and none of their requests outlives the group's call.

* ``JsonScorerReward`` POSTs ``{"uid", "task", "prompt", "response", "answer"}`` and reads the number
  at ``score_field`` of the reply (``{"score": 0.7}``), checked against the optional
  [min_score, max_score] ([0, 1] unless widened). A reply that echoes an id (``uid``: the sample's, or ``idempotency_key``:
  the request's header) must echo this request's: one echoing another's (a shuffled or cached
  reply behind a gateway) is rejected as ``mismatched_reply``, counted and retried. A chat
  completion echoes nothing of the request, so the judge cannot tell.
* ``OpenAIJudgeReward`` POSTs a chat-completions request (or a completions one, for servers whose
  model has no chat template) whose user message is ``prompt_template`` filled with
  ``{prompt}``, ``{response}`` and ``{answer}``. The reply's text (a string, or the text parts of
  a list of content parts, concatenated as the OpenAI SDK does) is searched for ``score_pattern``;
  the last match (``score_match``) is the score — judges write their reasoning first, and "Rating
  (0-10): 7" must give 7, not 0 — read from the pattern's group ``score``, else its first group,
  else the whole match; checked against [min_score, max_score] (by default the scale the template
  states, "from 0 to 10"), divided by ``max_score``. The default pattern reads "7/10" and "8 out
  of 10" as 7 and 8.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.rewards.base import RewardResult, TimedResults, Unscored
from asyncrl.rewards.budget import SharedLimiter, budget_of
from asyncrl.rewards.http import CallFailed, HttpClient, HttpConfig
from asyncrl.wire.schema import Group, Sample

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "Rate the answer to the question from 0 to 10. Reply with the number only.\n"
    "Question: {prompt}\nReference: {answer}\nAnswer: {response}\nScore:"
)
DEFAULT_PATTERN = r"(-?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*\d+(?:\.\d+)?)?"
"""A number, optionally followed by its scale ("7/10", "8 out of 10"): the group is the score."""


class JsonScorerConfig(HttpConfig):
    """A generic JSON scoring endpoint."""

    score_field: str = "score"
    """Key of the number in the reply's JSON object."""
    min_score: float | None = 0.0
    """Smallest valid score; a smaller one leaves the sample unscored (``score_out_of_range``).
    0 by default (a reward in [0, 1]); widen it for a scorer with another scale; null: no bound."""
    max_score: float | None = 1.0
    """Largest valid score; a larger one leaves the sample unscored (``score_out_of_range``).
    1 by default (a reward in [0, 1]); widen it for a scorer with another scale; null: no bound."""

    @model_validator(mode="after")
    def check_range(self) -> JsonScorerConfig:
        if self.min_score is not None and self.max_score is not None and self.min_score > self.max_score:
            raise ValueError(f"min_score ({self.min_score}) must be <= max_score ({self.max_score})")
        return self

    @property
    def score_range(self) -> tuple[float, float]:
        """[min_score, max_score], an unset bound infinite."""
        low, high = self.min_score, self.max_score
        return (-math.inf if low is None else low, math.inf if high is None else high)


SCALE = re.compile(
    r"(?:from|between)\s+(-?\d+(?:\.\d+)?)\s+(?:to|and)\s+(-?\d+(?:\.\d+)?)|\((-?\d+(?:\.\d+)?)\s*-\s*(\d+(?:\.\d+)?)\)"
)
"""A scale in a judge's prompt: "from 0 to 10", "between 1 and 5", "(1-5)"."""


def template_scale(template: str) -> tuple[float, float] | None:
    """The first scale ``SCALE`` finds in ``template`` as (low, high), None when there is none.

    >>> template_scale("Rate the answer from 1 to 5.")
    (1.0, 5.0)
    """
    match = SCALE.search(template)
    if match is None:
        return None
    low, high = (g for g in match.groups() if g is not None)
    return float(low), float(high)


class JudgeConfig(HttpConfig):
    """An OpenAI-compatible judge (``/v1/chat/completions`` or ``/v1/completions`` at ``url``)."""

    model: str = "judge"
    """Model name sent in the request."""
    endpoint: Literal["chat", "completions"] = "chat"
    """Request shape: chat (messages) or completions (a prompt string)."""
    prompt_template: str = DEFAULT_TEMPLATE
    """The judge's prompt; ``{prompt}``, ``{response}`` and ``{answer}`` are filled in (write ``{{`` for a brace)."""
    score_pattern: str = DEFAULT_PATTERN
    """Regex searched in the judge's reply; the score is its group ``score``, else its first group, else the match."""
    score_match: Literal["first", "last"] = "last"
    """Which match of ``score_pattern`` is the score: the last (judges reason first, then score) or the first."""
    min_score: float = 0.0
    """Smallest valid score; outside [min_score, max_score] the sample is unscored (``score_out_of_range``).
    Unset, it is read from the template's scale ("from 1 to 5"), else 0."""
    max_score: float = Field(10.0, gt=0)
    """Largest valid score; the reward is score / max_score. Unset, it is read from the first scale
    the template states ("from 0 to 10", "between 1 and 5", "(1-5)"), else 10; set both bounds
    when the template's first such phrase is not the score's scale."""
    max_tokens: int = Field(8, ge=1)
    """Tokens the judge may write."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """More request fields, e.g. vLLM's ``{min_tokens: 1}`` or ``{seed: 0}``."""

    @field_validator("score_pattern")
    @classmethod
    def check_pattern(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"score_pattern ({pattern!r}) must be a regular expression: {e}") from None
        return pattern

    @field_validator("prompt_template")
    @classmethod
    def check_template(cls, template: str) -> str:
        try:
            template.format(prompt="", response="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt_template may use only {{prompt}}, {{response}} and {{answer}} (and {{{{ for a brace): "
                f"{type(e).__name__} {e}"
            ) from None
        return template

    @model_validator(mode="after")
    def check_range(self) -> JudgeConfig:
        scale = template_scale(self.prompt_template)
        if scale is not None:  # the template's scale, where the user did not set a bound
            if "min_score" not in self.model_fields_set:
                self.min_score = scale[0]
            if "max_score" not in self.model_fields_set and scale[1] > 0:
                self.max_score = scale[1]
        if self.min_score >= self.max_score:
            raise ValueError(f"min_score ({self.min_score}) must be < max_score ({self.max_score})")
        return self


def check_shared_budgets(spec_sets) -> None:
    """HTTP rewards calling one host with one ``api_key_env`` share one rate budget
    (``asyncrl.rewards.budget``): a ValueError naming both when two state it differently.
    ``spec_sets``: lists of ``RewardSpec`` (``RewardConfig.specs_by_task().values()``)."""
    seen: dict[str, tuple[str, tuple]] = {}  # budget id -> (the first reward naming it, its limits)
    for specs in spec_sets:
        for spec in (s for s in specs if s.kind in ("http_json", "openai_judge")):
            options = (JsonScorerConfig if spec.kind == "http_json" else JudgeConfig)(**spec.options)
            budget = budget_of(options)
            limits = (budget.concurrency, budget.rpm, budget.tpm, options.burst_s)
            first, stated = seen.setdefault(budget.budget, (spec.label, limits))
            if stated != limits:
                raise ValueError(
                    f"rewards {first!r} and {spec.label!r} call one host with one api_key_env, so they share "
                    f"one rate budget and must state the same (concurrency, rpm, tpm, burst_s): {stated} vs {limits}"
                )


class _HttpReward:
    per_sample = True
    """One request per sample, independent of the others: a requeued group re-requests only what failed."""

    def __init__(self, name: str, cfg: HttpConfig, limiter: SharedLimiter | None = None):
        self.name = name
        self.cfg = cfg
        self.client = HttpClient(name, cfg, limiter)

    async def score(self, group: Group) -> TimedResults:
        # A task group: should anything escape a sample's handler, its siblings are cancelled, not orphaned.
        async with asyncio.TaskGroup() as tasks:
            timed = [tasks.create_task(self._score_sample(group, s)) for s in group.samples]
        return TimedResults([t.result()[0] for t in timed], [t.result()[1] for t in timed])

    async def _score_sample(self, group: Group, sample: Sample) -> tuple[RewardResult, float]:
        start = time.perf_counter()
        try:
            result = await self.score_one(group, sample)
        except CallFailed as e:
            result = Unscored(e.kind, e.detail)
        except Exception as e:  # a reply or sample this code did not foresee: this sample only is unscored
            log.warning("%s: scoring %s raised %s", self.name, sample.uid, type(e).__name__, exc_info=True)
            result = Unscored(f"error: {type(e).__name__}", str(e)[:200])
        return result, time.perf_counter() - start

    def idempotency_key(self, sample: Sample) -> str:
        """Unique per reward and sample: two rewards scoring one sample send different requests."""
        return f"{self.name}:{sample.uid}"

    async def score_one(self, group: Group, sample: Sample) -> RewardResult:
        raise NotImplementedError

    async def close(self) -> None:
        await self.client.close()


class JsonScorerReward(_HttpReward):
    """One POST per sample to a JSON scorer; the reply's ``score_field`` is the reward."""

    cfg: JsonScorerConfig

    @property
    def score_range(self) -> tuple[float, float]:
        """[min_score, max_score]: [0, 1] unless widened."""
        return self.cfg.score_range

    def check_reply(self, reply: dict, sample: Sample, key: str) -> None:
        """A reply for another request (``mismatched_reply``) or without ``score_field`` (``bad_reply``) is retried."""
        check_echo(reply, sample.uid, key)
        if self.cfg.score_field not in reply:
            raise CallFailed("bad_reply", f"no {self.cfg.score_field!r} in {json.dumps(reply)[:160]}")

    async def score_one(self, group: Group, sample: Sample) -> RewardResult:
        body = {
            "uid": sample.uid,
            "task": group.task,
            "prompt": group.prompt,
            "response": sample.text,
            "answer": group.answer,
        }
        key = self.idempotency_key(sample)
        reply = await self.client.post_json(body, idempotency_key=key, check=lambda r: self.check_reply(r, sample, key))
        value = reply.get(self.cfg.score_field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Unscored("bad_score", f"{self.cfg.score_field}={value!r}"[:200])
        low, high = self.cfg.score_range
        if not low <= value <= high:
            return Unscored("score_out_of_range", f"{value} not in [{low}, {high}] (min_score, max_score)")
        return float(value)


ECHO_FIELDS = ("uid", "idempotency_key")
"""Fields of a JSON scorer's reply that, when present, must echo the request's sample uid or idempotency key."""


def check_echo(reply: dict, uid: str, key: str) -> None:
    """Raise ``CallFailed("mismatched_reply")`` (retried) when ``reply`` echoes the id of another
    request: its ``uid`` is not the sample's, or its ``idempotency_key`` not the request's. A reply
    that echoes neither cannot be checked and is taken as is."""
    for field, expected in zip(ECHO_FIELDS, (uid, key)):
        echoed = reply.get(field)
        if echoed is not None and echoed != expected:
            raise CallFailed("mismatched_reply", f"{field}={echoed!r} in the reply to {expected!r}"[:200])


def reply_text(content: Any) -> str | None:
    """The text of a reply's content: a string; a number as written; the text parts of a list of
    content parts (``[{"type": "text", "text": ...}]``) concatenated; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, (int, float)) and not isinstance(content, bool):
        return str(content)
    if isinstance(content, list):
        texts = [p if isinstance(p, str) else p.get("text") for p in content if isinstance(p, (str, dict))]
        return "".join(t for t in texts if isinstance(t, str))
    return None


class OpenAIJudgeReward(_HttpReward):
    """An LLM judge behind an OpenAI-compatible API; see the module docstring."""

    cfg: JudgeConfig

    def __init__(self, name: str, cfg: JudgeConfig, limiter: SharedLimiter | None = None):
        super().__init__(name, cfg, limiter)
        self.pattern = re.compile(cfg.score_pattern)
        self.score_range = (cfg.min_score / cfg.max_score, 1.0)
        """The judge's scale [min_score, max_score] divided by max_score."""

    def request_body(self, group: Group, sample: Sample) -> dict:
        text = self.cfg.prompt_template.format(prompt=group.prompt, response=sample.text, answer=group.answer)
        body = {"model": self.cfg.model, "max_tokens": self.cfg.max_tokens, "temperature": 0.0, **self.cfg.extra_body}
        if self.cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    def check_reply(self, reply: dict) -> None:
        """A reply without ``choices[0]``'s text is of the wrong shape: ``bad_reply``, retried."""
        try:
            choice = reply["choices"][0]
            content = choice["message"]["content"] if self.cfg.endpoint == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise CallFailed("bad_reply", json.dumps(reply)[:200]) from None
        if reply_text(content) is None:
            raise CallFailed("bad_reply", f"content is a {type(content).__name__}: {content!r}"[:200])

    def parse_score(self, reply: dict) -> RewardResult:
        try:
            choice = reply["choices"][0]
            content = choice["message"]["content"] if self.cfg.endpoint == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError):
            return Unscored("bad_reply", str(reply)[:200])
        text = reply_text(content)
        if text is None:
            return Unscored("bad_reply", f"content is a {type(content).__name__}: {content!r}"[:200])
        matches = list(self.pattern.finditer(text))
        if not matches:
            return Unscored("unparsable_score", repr(text)[:200])
        match = matches[-1] if self.cfg.score_match == "last" else matches[0]
        if "score" in self.pattern.groupindex:
            raw = match.group("score")
        else:
            raw = match.group(1) if self.pattern.groups else match.group()
        try:
            score = float(raw)
        except (TypeError, ValueError):  # the group did not take part, or is not a number
            return Unscored("unparsable_score", f"{raw!r} in {text!r}"[:200])
        if not (self.cfg.min_score <= score <= self.cfg.max_score):  # NaN fails too
            return Unscored("score_out_of_range", f"{score} not in [{self.cfg.min_score}, {self.cfg.max_score}]")
        return score / self.cfg.max_score

    async def score_one(self, group: Group, sample: Sample) -> RewardResult:
        body = self.request_body(group, sample)
        text = body.get("prompt") or body["messages"][0]["content"]
        tokens = len(text) / 4 + self.cfg.max_tokens  # a rough count for the tokens-per-minute bucket
        key = self.idempotency_key(sample)
        reply = await self.client.post_json(body, idempotency_key=key, tokens=tokens, check=self.check_reply)
        return self.parse_score(reply)
