"""Partial rollouts in continuous generation: answers too stale to finish are aborted and resumed.

With ``generator.partial_rollouts: resume`` (AReaL's interruptible generation), after each weight
update a generator aborts every answer still running whose oldest token is more than the
staleness bound S behind the version it now serves, v, i.e. ``version(oldest) < v - S``, and
resumes it under v from its prompt + the tokens it has so far (``asyncrl.generators.resume``):
those tokens keep their behaviour logprobs and versions, the rest is sampled by v, and the
answer's ``version_segments`` record the switch. Its stale tokens stay in the answer as context
and leave the loss at the buffer (``asyncrl.buffer.stale_segments``), as with ``mask``.

The bound is ``buffer.max_staleness``; under ``auto`` the learner moves it and a generator does not
hear it, so the ceiling ``auto_staleness.max`` is used: an answer past it is too stale under any
bound the learner may set, and what the lower bound of the moment makes stale is masked.

Accounting: each interruption is counted on the answer (``Completion.resumed``); when its group is
sent the generator writes one ledger line ``resumed`` naming the group once per interruption of its
answers, and counts them in its final report (``resumed``), so ``summary.json``'s
``partial_rollouts.resumed`` and the ledger replay's agree.

A stream that resumes answers (``MockStream``, ``VLLMStream`` with ``answers_apart``) has
``resume_older_than(version) -> answers interrupted``.
"""

from __future__ import annotations

import asyncio
import logging

from asyncrl.generators.completion import Completion
from asyncrl.generators.sampling import derive_seed
from asyncrl.observability.metrics import PARTIAL_ROLLOUTS

log = logging.getLogger(__name__)


def resume_bound(cfg) -> int | None:
    """The staleness bound past which a running answer is resumed: None unless
    ``generator.partial_rollouts`` is ``resume`` (see the module docstring for ``auto``)."""
    if cfg.generator.partial_rollouts != "resume":
        return None
    bound = cfg.buffer.staleness_ceiling
    if bound is None:
        raise ValueError(
            "generator.partial_rollouts (resume) needs a staleness bound: buffer.max_staleness is null, "
            "so no answer is ever too stale to resume"
        )
    return bound


class StaleResumer:
    """After each weight update, has ``stream`` resume the answers more than ``bound`` versions behind.

    >>> class Stream:
    ...     def resume_older_than(self, version): return [0, 2, 5][version]
    >>> resumer = StaleResumer(Stream(), bound=1)
    >>> resumer.after_update(0), resumer.after_update(2), resumer.after_update(2)
    (0, 2, 0)
    """

    def __init__(self, stream, bound: int, name: str = ""):
        if bound < 0:
            raise ValueError(f"bound ({bound}) must be >= 0")
        self.stream, self.bound, self.name = stream, bound, name
        self.seen: int | None = None
        """The last version acted on (each update is acted on once)."""

    def after_update(self, version: int) -> int:
        """Resume the answers whose oldest token is older than ``version - bound``, once per
        version served; returns how many were interrupted."""
        if version == self.seen:
            return 0
        self.seen = version
        if version - self.bound <= 0:  # no version is older than 0
            return 0
        interrupted = self.stream.resume_older_than(version - self.bound)
        if interrupted:
            log.info(
                "%s: version %d: %d answers holding tokens older than %d aborted and resumed",
                self.name,
                version,
                interrupted,
                version - self.bound,
            )
        return interrupted


def record_resumed(ledger, counts, group_id: str, completions: list[Completion]) -> int:
    """Write the interruptions of a group's answers to the ledger (``resumed``, the group named once
    per interruption) and add them to ``counts.resumed``; returns how many."""
    resumed = sum(c.resumed for c in completions)
    if resumed:
        ledger.write("resumed", [group_id] * resumed)
        counts.resumed += resumed
        PARTIAL_ROLLOUTS.labels("resumed").inc(resumed)
    return resumed


def answer_params(params, index: int):
    """vLLM ``SamplingParams`` of answer ``index`` of a group sampled as ``params`` (n answers),
    run as its own request: n = 1 and a seed of its own (None stays None)."""
    one = params.clone()
    one.n = 1
    if params.seed is not None:
        one.seed = derive_seed(params.seed, index)
    return one


async def resumable_answer(engine, prompt_ids: list[int], params, request_id: str) -> Completion:
    """One answer on ``engine`` (an ``AsyncVLLMEngine``), resumed under the weights loaded now
    each time it is aborted (``engine.resume_request``) until it ends by ``stop`` or ``length``.
    Cancelling the coroutine aborts it for good (its request is aborted by vLLM)."""
    completion = await engine.sample_request(prompt_ids, params, request_id)
    while completion.finish_reason == "abort":
        completion = await engine.resume_request(completion, params, f"{request_id}/r{completion.resumed + 1}")
    return completion


async def resumable_answers(engine, prompt_ids: list[int], params, key: str) -> list[Completion]:
    """The ``params.n`` answers of group ``key``, each its own ``resumable_answer`` (ids ``key/i``)."""
    return list(
        await asyncio.gather(
            *(resumable_answer(engine, prompt_ids, answer_params(params, i), f"{key}/{i}") for i in range(params.n))
        )
    )
