"""Held-out evaluation by the generators' own engines, while training goes on.

The controller splits the held-out prompts (``eval.num_prompts`` of the task's test split) into
requests of ``eval.chunk_prompts`` and offers them to the generators (``eval_request``, PUSH:
``transport.EvalRequestSender``). A generator takes at most one between two training batches
(``generators.evaluation``), decodes it greedily with the weights it serves, and sends back the
texts (``eval_result``, over the event stream); the controller scores them with the task's exact
match (each task apart too, ``by_task``, when a mix of sources gives prompts of several; prompts
without a reference answer are not scored). Evaluation is therefore never a training sample: it enters neither the dispatcher, the
buffer nor the ledger, and each generator counts it apart (``eval_prompts``, ``eval_s``).

One evaluation is a *round* (``before``, ``v40``, ``after``): at most ``eval.max_outstanding``
requests per generator are out at once, so a request waits behind at most one training batch,
not behind the whole held-out set. Its score is reported with the versions that produced it:
``version`` is the learner version the round was asked at, ``versions`` the lowest and highest
version the generators served while answering (equal before RL, after the final weights are
served, and whenever no publication fell inside the round).

Nothing waits forever. A request is given

    timeout = eval.timeout_floor_s + eval.timeout_factor × max_new_tokens × s_per_token

where ``s_per_token`` is the slowest measured so far (a request's round trip divided by its
``max_new_tokens``: queueing behind a training batch included, so it errs long), or
``eval.initial_s_per_token`` before anything was measured. A request past its timeout is offered
again (to whichever generator takes it) up to ``eval.max_retries`` times; then the round fails,
is logged and reported with no score, and training is not stopped for it.

Where no generator exists to ask (a simulated learner has no model), there is no evaluation;
``eval.engine: hf`` keeps the older path (``asyncrl.models.hf_eval``: Hugging Face on the
controller's CPU, float32), for comparisons on small models only.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.wire.messages import EvalRequest, EvalResult

log = logging.getLogger(__name__)


class EvalConfig(Config):
    """Held-out evaluation (the run's ``eval`` section)."""

    num_prompts: int = Field(500, ge=1)
    """Held-out prompts (the first of the task's test split) scored greedily in each evaluation."""
    max_new_tokens: int = Field(4, ge=1)
    """Greedy decoding length of the evaluation."""
    engine: Literal["generators", "hf"] = "generators"
    """Who decodes: the generators' engines, between training batches (the served weights, the
    engines' dtype); or ``hf``, Hugging Face on the controller's CPU in float32 (small models only,
    before and after RL only)."""
    before: bool = True
    """Evaluate the initial weights (as served) before the RL phase opens: ``eval_before``."""
    after: bool = True
    """Evaluate the final weights once every generator serves them: ``eval_after``."""
    every_versions: int | None = Field(None, ge=0)
    """Also evaluate during training, each time the learner reaches a multiple of this many
    versions, without pausing it (None or 0: only before and after)."""
    chunk_prompts: int = Field(64, ge=1)
    """Prompts per evaluation request (one engine call of a generator)."""
    max_outstanding: int = Field(1, ge=1)
    """Requests of a round out at once, per generator."""
    timeout_floor_s: float = Field(60.0, gt=0)
    """Seconds every request is given at least, on top of its decoding allowance."""
    timeout_factor: float = Field(5.0, ge=1)
    """Decoding allowance of a request: this many times ``max_new_tokens`` × the slowest seconds per token measured."""
    initial_s_per_token: float = Field(0.5, gt=0)
    """Seconds per generated token assumed before one is measured (generous: a 7 B model on a GPU
    takes ~0.02-0.1 s per decoding step, a 0.5 B one on two CPU cores ~0.1-0.3 s)."""
    max_retries: int = Field(1, ge=0)
    """Times a request past its timeout is offered again before its round fails."""

    @property
    def periodic(self) -> bool:
        return bool(self.every_versions)


class EvalRound:
    """One evaluation of the held-out prompts: its requests, their answers, its score.

    >>> from asyncrl.tasks.prompts import Prompt
    >>> prompts = [Prompt(str(i), f"{i}+1=", str(i + 1), "addition") for i in range(5)]
    >>> r = EvalRound("v2", 2, prompts, chunk_prompts=2, max_new_tokens=4)
    >>> [len(r.chunk_prompts(c)) for c in range(r.num_chunks)]
    [2, 2, 1]
    >>> for c in range(3):
    ...     _ = r.answer({"chunk": c, "version": 2, "generator": "g",
    ...                   "texts": [str(int(p.text[:-3]) + 1) for p in r.chunk_prompts(c)], "seconds": 0.1, "queued_s": 0})
    >>> r.done, r.record()["exact_match"]
    (True, 1.0)
    """

    def __init__(
        self, label: str, version: int, prompts: list, chunk_prompts: int, max_new_tokens: int, clock=time.monotonic
    ):
        if not prompts:
            raise ValueError("prompts (0 given) must hold at least one prompt")
        self.label, self.version, self.prompts = label, version, prompts
        self.chunk_size, self.max_new_tokens = chunk_prompts, max_new_tokens
        self.num_chunks = -(-len(prompts) // chunk_prompts)
        self.todo = list(range(self.num_chunks))  # not offered yet (or to be offered again)
        self.out: dict[int, dict] = {}  # chunk -> {sent (monotonic), deadline, tries}
        self.tries: dict[int, int] = {}
        self.correct: dict[int, float] = {}  # chunk -> sum of exact match over its prompts
        self.by_task: dict[str, list[float]] = {}  # task -> [sum of exact match, prompts scored]
        self.scorable = sum(1 for p in prompts if p.answer)  # a prompt without an answer has no exact match
        self.versions: set[int] = set()
        self.generators: dict[str, int] = {}  # generator -> prompts it answered
        self.clock = clock
        self.started = clock()
        self.failed: str | None = None
        self.seconds = 0.0  # decoding seconds, summed over the generators

    def chunk_prompts(self, chunk: int) -> list:
        return self.prompts[chunk * self.chunk_size : (chunk + 1) * self.chunk_size]

    def request(self, chunk: int) -> EvalRequest:
        """The ``eval_request`` of ``chunk``."""
        return EvalRequest(
            round=self.label,
            chunk=chunk,
            version=self.version,
            prompts=[p.text for p in self.chunk_prompts(chunk)],
            max_new_tokens=self.max_new_tokens,
            sent_at=time.time(),
        )

    def answer(self, body: EvalResult) -> float | None:
        """Score an ``eval_result``; returns the request's round trip in
        seconds (None: a late or repeated answer, ignored)."""
        from asyncrl.tasks.answers import score_answer

        chunk = body.chunk
        if chunk in self.correct or not 0 <= chunk < self.num_chunks:
            return None
        prompts = self.chunk_prompts(chunk)
        if len(body.texts) != len(prompts):
            log.warning(
                "eval %s: chunk %d came back with %d answers for %d prompts; ignored",
                self.label,
                chunk,
                len(body.texts),
                len(prompts),
            )
            return None
        scores = [(p.task, score_answer(p.task, t, p.answer)) for p, t in zip(prompts, body.texts) if p.answer]
        self.correct[chunk] = sum(value for _, value in scores)
        for task, value in scores:
            tally = self.by_task.setdefault(task, [0.0, 0])
            tally[0] += value
            tally[1] += 1
        self.versions.add(body.version)
        self.generators[body.generator] = self.generators.get(body.generator, 0) + len(prompts)
        self.seconds += body.seconds
        sent = self.out.pop(chunk, None)
        if chunk in self.todo:
            self.todo.remove(chunk)
        return None if sent is None else self.clock() - sent["sent"]

    @property
    def done(self) -> bool:
        return self.failed is not None or len(self.correct) == self.num_chunks

    def record(self) -> dict:
        """What the run writes about this round (``evals.jsonl``, the console, TensorBoard); with
        prompts of several tasks (a mix of sources), ``by_task`` holds each one's exact match."""
        scored = len(self.correct) == self.num_chunks and self.failed is None and self.scorable > 0
        record = {
            "type": "eval",
            "label": self.label,
            "version": self.version,
            "versions": [min(self.versions), max(self.versions)] if self.versions else None,
            "exact_match": sum(self.correct.values()) / self.scorable if scored else None,
            "num_prompts": len(self.prompts),
            "generators": dict(sorted(self.generators.items())),
            "wall_s": self.clock() - self.started,
            "decode_s": self.seconds,
            "failed": self.failed,
        }
        if len({p.task for p in self.prompts}) > 1:
            record["by_task"] = {t: (v / n if scored else None) for t, (v, n) in sorted(self.by_task.items())}
        return record


class HeldOutEvaluator:
    """The controller's side: rounds started, requests offered and timed, answers scored.

    ``start(label, version)`` opens a round (one at a time: a periodic round due while another
    runs is skipped, and said so); ``poll(num_generators)`` offers requests and handles timeouts
    (call it in the event loop); ``answer(body)`` takes an ``eval_result`` and returns the
    round's record once it is complete (or failed).
    """

    def __init__(self, cfg: EvalConfig, prompts: list, sender, clock=time.monotonic):
        self.cfg, self.prompts, self.sender, self.clock = cfg, prompts, sender, clock
        self.current: EvalRound | None = None
        self.s_per_token: float | None = None  # slowest measured: a round trip / max_new_tokens

    def start(self, label: str, version: int) -> bool:
        if self.current is not None:
            log.warning(
                "eval %s skipped: eval %s is still running (%d of %d requests answered)",
                label,
                self.current.label,
                len(self.current.correct),
                self.current.num_chunks,
            )
            return False
        self.current = EvalRound(
            label, version, self.prompts, self.cfg.chunk_prompts, self.cfg.max_new_tokens, clock=self.clock
        )
        return True

    def timeout_s(self) -> float:
        """Seconds one request may take (see the module docstring)."""
        per_token = self.s_per_token if self.s_per_token is not None else self.cfg.initial_s_per_token
        return self.cfg.timeout_floor_s + self.cfg.timeout_factor * self.cfg.max_new_tokens * per_token

    def poll(self, num_generators: int) -> dict | None:
        """Offer what the window allows; time out what is late. Returns the record of a round
        that failed just now, else None."""
        r = self.current
        if r is None:
            return None
        now = self.clock()
        for chunk, sent in list(r.out.items()):
            if now > sent["deadline"]:
                del r.out[chunk]
                r.tries[chunk] = r.tries.get(chunk, 0) + 1
                if r.tries[chunk] > self.cfg.max_retries:
                    r.failed = (
                        f"request {chunk} unanswered {r.tries[chunk]} times within {sent['timeout']:.0f} s "
                        "(eval.timeout_floor_s + eval.timeout_factor x max_new_tokens x s/token)"
                    )
                    log.error("eval %s failed: %s", r.label, r.failed)
                    return self._finish()
                log.warning(
                    "eval %s: request %d unanswered after %.0f s; offering it again", r.label, chunk, sent["timeout"]
                )
                r.todo.insert(0, chunk)
        window = max(1, num_generators) * self.cfg.max_outstanding
        while r.todo and len(r.out) < window:
            chunk = r.todo[0]
            if not self.sender.offer(r.request(chunk)):
                break  # no generator can take it now: offered again at the next poll
            r.todo.pop(0)
            timeout = self.timeout_s()
            r.out[chunk] = {"sent": now, "deadline": now + timeout, "timeout": timeout}
        return None

    def answer(self, body: EvalResult) -> dict | None:
        """Take an ``eval_result``; the round's record when this completed it."""
        r = self.current
        if r is None or body.round != r.label:
            return None  # an answer to a round that has ended
        round_trip = r.answer(body)
        if round_trip is not None:
            per_token = round_trip / r.max_new_tokens
            self.s_per_token = per_token if self.s_per_token is None else max(self.s_per_token, per_token)
        return self._finish() if r.done else None

    def _finish(self) -> dict:
        record, self.current = self.current.record(), None
        return record
