"""One agent episode's state in the gateway: its token, its calls, its reward, its end.

A call is sampled with the **run's** sampling settings (``sampling.temperature``, ``top_p``,
``top_k``, and its stop strings and tokens), whatever the request asks: the learner's importance
ratio divides by the probability of each token under the distribution the run declares, so a
request that sampled hotter, with a penalty or a logit bias would train on ratios that are wrong.
Such request fields are ignored, and an episode in which a request asked otherwise is counted and
logged once. What only cuts an answer short is honoured: the request's ``stop`` strings, and its
``max_tokens`` up to min(``sampling.max_tokens``, the room ``max_model_len`` leaves).

Calls of one episode are sampled one at a time (a lock): each is recorded against the one before
(``asyncrl.generators.gateway.recorder``), so their order must be the order they were sampled in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets

from asyncrl.generators.completion import Completion
from asyncrl.generators.gateway.recorder import Context, EpisodeRecorder
from asyncrl.generators.sampling import derive_seed

log = logging.getLogger(__name__)

IGNORED_NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "min_tokens": 0,
    "seed": None,
    "logit_bias": None,
}
"""Request fields that would change the sampled distribution: ignored unless neutral (field -> neutral)."""


class GatewayError(Exception):
    """A refused request: the HTTP status, the OpenAI error type, and a message naming the rule."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.type = status, type_


def turn_params(sampling, max_tokens: int, stop: list[str], seed: int | None):
    """vLLM's ``SamplingParams`` of one call: the run's distribution, the call's limits."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
        top_k=sampling.top_k,
        max_tokens=max_tokens,
        stop=stop or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        logprobs=0,  # the sampled token's: the behaviour logprob
        seed=seed,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


class AgentEpisode:
    """One episode's calls (``chat``, ``complete``) and its end (``post_reward``, ``close``)."""

    def __init__(
        self,
        name: str,
        engine,
        recorder: EpisodeRecorder,
        sampling,
        max_model_len: int,
        max_calls: int,
        seed: int | None,
        episode_index: int,
        params=turn_params,
    ):
        self.name, self.engine, self.recorder, self.sampling = name, engine, recorder, sampling
        self.max_model_len, self.max_calls = max_model_len, max_calls
        self.seed, self.episode_index, self.params = seed, episode_index, params
        self.token = secrets.token_urlsafe(24)
        self.closed = False
        self.reward: float | None = None
        self.rewarded = asyncio.Event()
        self.ignored: set[str] = set()
        """Request fields this episode asked for and the gateway ignored (logged once)."""
        self.failure: BaseException | None = None
        """What the engine raised during a call, if anything."""
        self._lock = asyncio.Lock()
        self._calls: set[asyncio.Task] = set()
        self._started = 0

    def note_ignored(self, body: dict) -> None:
        s = self.sampling
        asked = {k for k in ("temperature", "top_p", "top_k") if body.get(k) not in (None, getattr(s, k))}
        asked |= {k for k, neutral in IGNORED_NEUTRAL.items() if body.get(k) not in (None, neutral, {})}
        if asked and not self.ignored:  # once per episode
            log.info(
                "agent episode %s asked for %s: ignored, the run samples with its own settings "
                "(temperature %g, top_p %g, top_k %d) that the learner's importance ratio assumes",
                self.name,
                ", ".join(sorted(asked)),
                s.temperature,
                s.top_p,
                s.top_k,
            )
        self.ignored |= asked

    async def chat(self, messages: list, max_tokens: int | None, stop: list[str]) -> tuple[Completion, int]:
        """Sample the assistant's reply to ``messages``: (the turn, prompt tokens)."""
        if self.recorder.renderer is None:
            raise GatewayError(400, "the model has no chat template: use /completions with a raw prompt")
        return await self._call(lambda: self.recorder.context_for_chat(messages), max_tokens, stop)

    async def complete(self, prompt: str, max_tokens: int | None, stop: list[str]) -> tuple[Completion, int]:
        """Sample a continuation of the raw ``prompt``: (the turn, prompt tokens)."""
        return await self._call(lambda: self.recorder.context_for_text(prompt), max_tokens, stop)

    async def _call(self, make_context, max_tokens: int | None, stop: list[str]) -> tuple[Completion, int]:
        async with self._lock:
            self._check_open()
            if self._started >= self.max_calls:
                raise GatewayError(400, f"episode {self.name} made {self.max_calls} calls: no more (agent.max_calls)")
            try:
                context: Context = make_context()
            except ValueError as e:
                raise GatewayError(400, str(e)) from e
            room = self.max_model_len - len(context.ids)
            if room < 1:
                raise GatewayError(
                    400,
                    f"the context has {len(context.ids)} tokens; it must have fewer than max_model_len "
                    f"({self.max_model_len})",
                    "context_length_exceeded",
                )
            limit = min(self.sampling.max_tokens, room)
            if max_tokens is not None:
                limit = min(limit, max_tokens)
            index = self._started
            self._started += 1
            seed = None if self.seed is None else derive_seed(self.seed, self.episode_index * 1000 + index)
            params = self.params(self.sampling, limit, list(self.sampling.stop) + stop, seed)
            task = asyncio.ensure_future(self.engine.sample_request(context.ids, params, f"{self.name}/c{index}"))
            self._calls.add(task)
            try:
                await asyncio.wait({task})  # a task cancelled by close() ends the wait, not this handler
            except asyncio.CancelledError:
                task.cancel()  # the client went away: vLLM aborts the request
                raise
            finally:
                self._calls.discard(task)
            self._check_open()  # closed while sampling: the turn is not the episode's
            if task.exception() is not None:
                self.failure = task.exception()  # the engine's failure is the generator's (AgentGroups raises it)
                raise GatewayError(500, f"the engine failed: {self.failure!r:.200}", "server_error")
            turn = task.result()
            self.recorder.add_turn(context, turn)
            return turn, len(context.ids)

    def _check_open(self) -> None:
        if self.closed:
            raise GatewayError(409, f"episode {self.name} is over: no call is taken after its reward or its end")

    def post_reward(self, value) -> None:
        """The program's reward: the episode ends (later calls are refused)."""
        self._check_open()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise GatewayError(400, f"reward ({value!r:.40}) must be a finite number")
        self.reward = float(value)
        self.closed = True
        self.rewarded.set()

    async def close(self) -> None:
        """End the episode: refuse calls from now on and cancel those in flight (their engine
        requests are aborted)."""
        self.closed = True
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
