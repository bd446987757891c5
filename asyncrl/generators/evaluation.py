"""A generator's part of held-out evaluation: one request between two training batches.

The controller offers ``eval_request``s (``asyncrl.tasks.heldout``); each turn of the generator loop
takes at most one (``EvalRequestReceiver.take`` never waits), decodes its prompts greedily with
the weights the engine serves, and sends the texts back as an ``eval_result``. One training batch,
then at most one evaluation request: neither starves the other, and an evaluation never pauses
training for longer than one request. Evaluation answers are not samples: they go to the
controller only, never to the reward workers, the buffer or the ledger, and are counted apart
(``EvalCounters``: ``eval_prompts``, ``eval_s`` in the generator's final report).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from asyncrl.generators.context import GeneratorContext
from asyncrl.observability.metrics import EVAL_PROMPTS, EVAL_SECONDS
from asyncrl.wire.messages import EvalResult

log = logging.getLogger(__name__)


@dataclass
class EvalCounters:
    prompts: int = 0
    """Held-out prompts this generator answered."""
    seconds: float = 0.0
    """Seconds it spent decoding them (not counted as busy: they are not training samples)."""
    requests: int = 0


def answer_eval_request(engine, receiver, ctx: GeneratorContext, counters: EvalCounters) -> bool:
    """Take one waiting request, if any, answer it, send the answer; True if one was answered.

    A prompt the engine refuses (too long for ``engine.max_model_len``) fails the request, not
    the generator: every prompt of it is answered with an empty text (scored wrong), and the
    reason is logged."""
    request = receiver.take()
    if request is None:
        return False
    queued_s = max(0.0, time.time() - request.sent_at)
    version = engine.version
    start = time.monotonic()
    try:
        texts = engine.greedy(request.prompts, request.max_new_tokens)
    except ValueError as e:
        log.warning("%s: eval %s request %d refused: %s", ctx.name, request.round, request.chunk, e)
        texts = [""] * len(request.prompts)
    seconds = time.monotonic() - start
    counters.prompts += len(texts)
    counters.seconds += seconds
    counters.requests += 1
    EVAL_PROMPTS.inc(len(texts))
    EVAL_SECONDS.inc(seconds)
    ctx.report(
        EvalResult(
            round=request.round,
            chunk=request.chunk,
            generator=ctx.name,
            version=version,
            texts=list(texts),
            seconds=seconds,
            queued_s=queued_s,
        )
    )
    return True
