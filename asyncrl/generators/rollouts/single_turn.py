"""Single answers: the first rollout. n samples of one prompt, as one vLLM request.

One request of n shares the prompt's KV cache between the n answers and returns when all are
done (``FINAL_ONLY``). With ``answers_apart`` (``generator.partial_rollouts: resume``) each answer
is its own request instead, so that one about to turn too stale can be aborted and resumed under
newer weights (``asyncrl.generators.interrupt``).
"""

from __future__ import annotations

from typing import Any

from asyncrl.generators.completion import Completion
from asyncrl.generators.interrupt import resumable_answers
from asyncrl.generators.sampling import SamplingConfig


class SingleTurn:
    """``sampling.n`` answers with vLLM ``params`` (built from ``sampling`` and the group's seed
    by the stream) on ``engine`` (an ``AsyncVLLMEngine``)."""

    def __init__(self, engine, sampling: SamplingConfig, params, answers_apart: bool = False):
        self.engine, self.sampling, self.params, self.answers_apart = engine, sampling, params, answers_apart

    async def sample(
        self, key: str, row: dict[str, Any] | None, prompt_ids: list[int], seed: int | None
    ) -> list[Completion]:
        if self.answers_apart:
            return await resumable_answers(self.engine, list(prompt_ids), self.params, key)
        return await self.engine.sample_group(prompt_ids, self.params)
