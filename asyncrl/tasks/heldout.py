"""Held-out evaluation by the generators' own engines, while training goes on.

The controller splits the held-out prompts (``eval.num_prompts`` of the task's test split, then
each of ``eval.sets``: ``asyncrl.tasks.eval_sets``) into requests of ``eval.chunk_prompts`` and
offers them to the generators (``eval_request``, PUSH: ``transport.EvalRequestSender``). A
generator takes at most one between two training batches (``generators.evaluation``), decodes it
with the weights it serves, greedily and, with ``eval.samples_k`` = k > 0, k times sampled at
``eval.temperature``, and sends back the texts with their finish reasons (``eval_result``, over
the event stream). The controller scores every answer with the run's own reward for its task
(``eval.reward``; ``asyncrl.rewards.evaluation``), off its event loop, and reports greedy
accuracy, completed correctness, mean@k and pass@k (``asyncrl.tasks.eval_metrics``) for the
task's split, for each task of a mix (``by_task``) and for each set (``sets``). Evaluation is
therefore never a training sample: it enters neither the dispatcher, the buffer nor the ledger,
and each generator counts it apart (``eval_prompts``, ``eval_s``).

Sampled answers are seeded per prompt from the run's seed and the prompt's id, the same in every
round, so two rounds' sampled figures differ by their weights, not by their noise.

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
is logged and reported with no score, and training is not stopped for it. Scoring a request's
answers is bounded by each reward's own timeout, and the whole of it by ``eval.score_timeout_s``.

Where no generator exists to ask (a simulated learner has no model), there is no evaluation;
``eval.engine: hf`` keeps the older path (``asyncrl.models.hf_eval``: Hugging Face on the
controller's CPU, float32), for comparisons on small models only.
"""

from __future__ import annotations

import logging
import time

from asyncrl.tasks.eval_config import EvalConfig
from asyncrl.tasks.eval_round import EvalRound
from asyncrl.wire.messages import EvalResult

log = logging.getLogger(__name__)


class HeldOutEvaluator:
    """The controller's side: rounds started, requests offered and timed, answers scored.

    ``start(label, version)`` opens a round (one at a time: a periodic round due while another
    runs is skipped, and said so); ``poll(num_generators)`` offers requests, handles timeouts and
    takes the scores that are ready (call it in the event loop); ``answer(body)`` takes an
    ``eval_result`` and hands its answers to ``scorer`` (``submit(prompts, answers)`` -> a
    ``concurrent.futures.Future`` of each prompt's values, ``EvalRound.score``). Either returns
    the round's record once it is complete (or failed).
    """

    def __init__(
        self,
        cfg: EvalConfig,
        prompts: list,
        sender,
        scorer,
        sets=None,
        seed: int = 0,
        clock=time.monotonic,
        episodes: bool = False,
    ):
        self.cfg, self.prompts, self.sender, self.scorer, self.clock = cfg, prompts, sender, scorer, clock
        self.sets, self.seed, self.episodes = sets, seed, episodes
        self.current: EvalRound | None = None
        self.scoring: dict[int, tuple] = {}  # chunk -> (future, deadline) of the current round
        self.s_per_token: float | None = None  # slowest measured: a round trip / max_new_tokens

    def start(self, label: str, version: int) -> bool:
        if self.current is not None:
            log.warning(
                "eval %s skipped: eval %s is still running (%d of %d requests scored)",
                label,
                self.current.label,
                len(self.current.scored),
                self.current.num_chunks,
            )
            return False
        self.current = EvalRound(
            label, version, self.prompts, self.cfg, self.sets, self.seed, clock=self.clock, episodes=self.episodes
        )
        self.scoring = {}
        return True

    def timeout_s(self) -> float:
        """Seconds one request may take (see the module docstring)."""
        per_token = self.s_per_token if self.s_per_token is not None else self.cfg.initial_s_per_token
        return self.cfg.timeout_floor_s + self.cfg.timeout_factor * self.cfg.max_new_tokens * per_token

    def round_bound_s(self, num_generators: int) -> float:
        """The longest the current round can run before it is scored or has failed: its requests
        in waves of ``num_generators × eval.max_outstanding``, each given ``timeout_s()`` and
        offered ``eval.max_retries`` more times (scoring aside, which runs beside the answers)."""
        window = max(1, num_generators) * self.cfg.max_outstanding
        waves = -(-self.current.num_chunks // window)
        return waves * self.timeout_s() * (self.cfg.max_retries + 1)

    def poll(self, num_generators: int) -> dict | None:
        """Take the scores that are ready, offer what the window allows, time out what is late.
        Returns the record of a round that ended just now (scored or failed), else None."""
        r = self.current
        if r is None:
            return None
        if self._collect():
            return self._finish()
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
        if body.chunk in r.answered and body.chunk not in self.scoring and body.chunk not in r.scored:
            prompts, answers = r.chunk_prompts(body.chunk), r.answers(body.chunk)
            if r.episodes:  # the environment's reward of each episode goes with its answer
                future = self.scorer.submit(prompts, answers, r.played(body.chunk))
            else:
                future = self.scorer.submit(prompts, answers)
            self.scoring[body.chunk] = (future, self.clock() + self.cfg.score_timeout_s)
        return self._finish() if self._collect() else None

    def _collect(self) -> bool:
        """Move finished scorings into the round; True once the round is done (scored or failed)."""
        r = self.current
        for chunk, (future, deadline) in list(self.scoring.items()):
            if future.done():
                del self.scoring[chunk]
                error = future.exception()
                if error is not None:
                    r.failed = f"scoring request {chunk} failed: {type(error).__name__}: {error}"
                    log.error("eval %s failed: %s", r.label, r.failed)
                else:
                    r.score(chunk, future.result())
            elif self.clock() > deadline:
                future.cancel()
                r.failed = f"request {chunk} not scored within eval.score_timeout_s ({self.cfg.score_timeout_s:g} s)"
                log.error("eval %s failed: %s", r.label, r.failed)
        return r.done

    def _finish(self) -> dict:
        record, self.current = self.current.record(), None
        labels = getattr(self.scorer, "labels", None)
        if labels:  # which reward decided what is correct, per task
            record["rewards"] = labels
        for future, _ in self.scoring.values():
            future.cancel()
        self.scoring = {}
        return record
