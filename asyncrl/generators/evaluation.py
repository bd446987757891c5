"""A generator's part of held-out evaluation: one request between two training batches.

The controller offers ``eval_request``s (``asyncrl.tasks.heldout``); each turn of the generator loop
takes at most one (``EvalRequestReceiver.take`` never waits), decodes its prompts with the
weights the engine serves, greedily and ``samples_k`` times sampled, in one engine call, ended by
the run's stop strings and stop token ids as training answers are (``sampling.stop``,
``sampling.stop_token_ids``), and sends back the texts and their finish reasons as an
``eval_result``. One training batch,
then at most one evaluation request: neither starves the other, and an evaluation never pauses
training for longer than one request. Evaluation answers are not samples: they go to the
controller only, never to the reward workers, the buffer or the ledger, and are counted apart
(``EvalCounters``: ``eval_prompts``, ``eval_s`` in the generator's final report).

A request is about the version the learner had reached when it was asked; with weights swapped in
flight it can arrive before the engine serves that version, so ``HeldForVersion`` keeps it until
the engine does (bounded), and the generator goes on generating meanwhile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from asyncrl.generators.context import GeneratorContext
from asyncrl.generators.sampling import AnswerOptions, SamplingConfig
from asyncrl.observability.metrics import EVAL_PROMPTS, EVAL_SECONDS
from asyncrl.wire.messages import EvalRequest, EvalResult

log = logging.getLogger(__name__)


@dataclass
class EvalCounters:
    prompts: int = 0
    """Held-out prompts this generator answered."""
    seconds: float = 0.0
    """Seconds it spent decoding them (not counted as busy: they are not training samples)."""
    requests: int = 0


class HeldForVersion:
    """The evaluation requests of one generator, each held until its engine serves the request's version.

    A round labelled v must score v's weights, but the controller asks it the moment the learner
    reaches v, while the new weights are still on their way to the engine. So ``take`` gives out
    a request only once ``engine.version >= request.version``, or once it has been held
    ``hold_s`` seconds: then it is answered with the weights served, and the gap is logged (the
    answer's ``version`` always says which weights answered). ``hold_s`` defaults to half the
    controller's shortest request timeout (``eval.timeout_floor_s``), so a held request is never
    given up and offered again by the controller. Waiting never blocks: ``take`` returns None.

    >>> class Receiver:
    ...     queue = [EvalRequest(round="v2", chunk=0, version=2, prompts=[], max_new_tokens=1, sent_at=0.0)]
    ...     def take(self): return self.queue.pop() if self.queue else None
    >>> class Engine: version = 0
    >>> now = [0.0]
    >>> held = HeldForVersion(Receiver(), Engine, hold_s=30.0, clock=lambda: now[0])
    >>> held.take() is None                  # v2 not served yet: held
    True
    >>> Engine.version = 2; held.take().round   # served: given out
    'v2'
    """

    def __init__(self, receiver, engine, hold_s: float, clock=time.monotonic):
        self.receiver = receiver
        self.engine = engine
        self.hold_s = hold_s
        self.clock = clock
        self.held: EvalRequest | None = None
        self.held_since = 0.0

    def take(self) -> EvalRequest | None:
        """The next request whose version the engine serves (or held past ``hold_s``); None if none."""
        if self.held is None:
            self.held = self.receiver.take()
            self.held_since = self.clock()
            if self.held is None:
                return None
        request, served = self.held, self.engine.version
        if served < request.version:
            if self.clock() - self.held_since < self.hold_s:
                return None
            log.warning(
                "eval %s chunk %d asked at version %d: held %.0f s (eval.timeout_floor_s / 2) and the "
                "engine still serves version %d; answered with it",
                request.round,
                request.chunk,
                request.version,
                self.hold_s,
                served,
            )
        self.held = None
        return request

    def close(self) -> None:
        self.receiver.close()


def answer_options(request: EvalRequest, sampling: SamplingConfig) -> tuple[list[str], list[AnswerOptions]]:
    """The prompts of one engine call and how each is answered: every prompt greedily, then every
    prompt ``samples_k`` times sampled with its seed (none when ``samples_k`` is 0).

    >>> r = EvalRequest(round="v2", chunk=0, version=2, prompts=["a", "b"], max_new_tokens=8,
    ...                 sent_at=0.0, samples_k=4, temperature=0.7, seeds=[11, 12])
    >>> prompts, options = answer_options(r, SamplingConfig(stop=["END"]))
    >>> prompts, [(o.n, o.temperature, o.seed, o.stop) for o in options]
    (['a', 'b', 'a', 'b'], [(1, 0.0, None, ('END',)), (1, 0.0, None, ('END',)), (4, 0.7, 11, ('END',)), (4, 0.7, 12, ('END',))])
    """
    ends = dict(
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
    )
    options = [AnswerOptions(request.max_new_tokens, **ends) for _ in request.prompts]
    prompts = list(request.prompts)
    if request.samples_k:
        if len(request.seeds) != len(request.prompts):
            raise ValueError(f"seeds ({len(request.seeds)}) must hold one per prompt ({len(request.prompts)})")
        prompts += request.prompts
        options += [
            AnswerOptions(request.max_new_tokens, request.samples_k, request.temperature, request.top_p, seed, **ends)
            for seed in request.seeds
        ]
    return prompts, options


def answer_eval_request(engine, receiver, ctx: GeneratorContext, counters: EvalCounters, episodes=None) -> bool:
    """Take one waiting request, if any, answer it, send the answer; True if one was answered.

    With ``episodes`` (an environment's run: ``asyncrl.generators.rollouts.episode_group``) each
    prompt is played as episodes, greedy and sampled, and the answer carries each episode's
    environment reward, turns and tool calls beside its last turn's text (``answer_with_episodes``).

    A prompt the engine refuses (too long for ``engine.max_model_len``) fails the request, not
    the generator: every prompt of it is answered with an empty text (scored wrong), and the
    reason is logged."""
    request = receiver.take()
    if request is None:
        return False
    queued_s = max(0.0, time.time() - request.sent_at)
    version = engine.version
    start = time.monotonic()
    played: dict[str, list] = {}
    if episodes is not None:
        answers, played = answer_with_episodes(engine, episodes, request, ctx)
    else:
        prompts, options = answer_options(request, ctx.cfg.sampling)
        try:
            answers = engine.answer(prompts, options)
        except ValueError as e:
            log.warning("%s: eval %s request %d refused: %s", ctx.name, request.round, request.chunk, e)
            answers = [[("", "error")] * o.n for o in options]
    seconds = time.monotonic() - start
    count = len(request.prompts)
    greedy, sampled = answers[:count], answers[count:]
    texts = [text for ((text, _),) in greedy]
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
            texts=texts,
            finish_reasons=[finish for ((_, finish),) in greedy],
            samples=[[text for text, _ in answers] for answers in sampled],
            sample_finish_reasons=[[finish for _, finish in answers] for answers in sampled],
            seconds=seconds,
            queued_s=queued_s,
            **played,
        )
    )
    return True


def answer_with_episodes(engine, episodes, request: EvalRequest, ctx: GeneratorContext):
    """An evaluation request played as episodes on the async engine: ``(answers, played)``, the
    answers laid out as ``engine.answer``'s (each prompt's greedy episode, then each prompt's
    ``samples_k`` sampled ones) and ``played`` the ``EvalResult`` fields of the episodes, one list
    per prompt, greedy first: ``env_rewards``, ``env_errors``, ``turns``, ``tool_calls``,
    ``tool_errors`` ({} when the request failed).

    The generator's thread waits for them as it waits for ``engine.answer``, at most
    ``eval.timeout_floor_s`` (the controller's shortest wait for a request: an answer later than
    that would be asked again elsewhere); past it, or if a prompt is refused, the request is
    answered with errors (scored wrong) and the episodes are cancelled."""
    count, k = len(request.prompts), request.samples_k
    failed = ([[("", "error")] for _ in range(count)] + [[("", "error")] * k for _ in range(count if k else 0)], {})
    if len(request.rows) != count:
        log.warning(
            "%s: eval %s request %d has %d rows for %d prompts: an environment needs each prompt's row",
            ctx.name,
            request.round,
            request.chunk,
            len(request.rows),
            count,
        )
        return failed
    try:
        prompt_ids = [list(t["prompt_token_ids"]) for t in engine.tokenize_prompts(request.prompts)]
    except ValueError as e:
        log.warning("%s: eval %s request %d refused: %s", ctx.name, request.round, request.chunk, e)
        return failed
    rows = [{**row, "text": text} for row, text in zip(request.rows, request.prompts)]
    bound = ctx.cfg.eval.timeout_floor_s
    future = engine.submit(episodes.evaluate(f"eval/{request.round}/{request.chunk}", rows, prompt_ids, request))
    try:
        played = future.result(timeout=bound)
    except Exception as e:  # a timeout included: the request fails, not the generator
        future.cancel()
        log.warning(
            "%s: eval %s request %d: the held-out episodes did not finish within %g s (eval.timeout_floor_s): %s",
            ctx.name,
            request.round,
            request.chunk,
            bound,
            e,
        )
        return failed
    greedy = [[(eps[0].text, eps[0].finish_reason)] for eps in played]
    sampled = [[(e.text, e.finish_reason) for e in eps[1:]] for eps in played] if k else []
    return greedy + sampled, {
        "env_rewards": [[e.env_reward for e in eps] for eps in played],
        "env_errors": [[e.env_error for e in eps] for eps in played],
        "turns": [[e.turns for e in eps] for eps in played],
        "tool_calls": [[e.tool_calls for e in eps] for eps in played],
        "tool_errors": [[e.tool_errors for e in eps] for eps in played],
    }
