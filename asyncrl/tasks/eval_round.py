"""One held-out evaluation round: its requests, the answers that came back, their scores, its record.

``asyncrl.tasks.heldout`` says how rounds are run; ``asyncrl.tasks.eval_metrics`` what the record's
figures are.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING

from asyncrl.tasks.eval_metrics import PromptScore, empty_metrics, round_metrics
from asyncrl.tasks.eval_sets import MAIN_SET
from asyncrl.wire.messages import EvalRequest, EvalResult

if TYPE_CHECKING:
    from asyncrl.tasks.eval_config import EvalConfig

log = logging.getLogger(__name__)


def prompt_seed(run_seed: int, prompt_uid: str) -> int:
    """The 31-bit seed of a prompt's sampled answers: a stable hash of (run seed, prompt id), the
    same in every round (not Python's ``hash``, which is salted per process).

    >>> prompt_seed(0, "addition/07+45") == prompt_seed(0, "addition/07+45") != prompt_seed(1, "addition/07+45")
    True
    """
    digest = hashlib.blake2b(f"{run_seed}/{prompt_uid}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


class EvalRound:
    """One evaluation of the held-out prompts: its requests, their answers, their scores.

    ``answer`` takes a generator's answers to one request; ``score`` takes their reward values
    (``asyncrl.rewards.evaluation.EvalScorer``); ``record`` reports the round.

    >>> from asyncrl.tasks.eval_config import EvalConfig
    >>> from asyncrl.tasks.prompts import Prompt
    >>> prompts = [Prompt(str(i), f"{i}+1=", str(i + 1), "addition") for i in range(5)]
    >>> r = EvalRound("v2", 2, prompts, EvalConfig(chunk_prompts=2))
    >>> [len(r.chunk_prompts(c)) for c in range(r.num_chunks)]
    [2, 2, 1]
    >>> for c in range(3):
    ...     texts = [str(int(p.text[:-3]) + 1) for p in r.chunk_prompts(c)]
    ...     _ = r.answer(EvalResult(round="v2", chunk=c, version=2, generator="g", texts=texts,
    ...                             finish_reasons=["stop"] * len(texts), seconds=0.1, queued_s=0))
    ...     r.score(c, [[1.0]] * len(texts))
    >>> r.done, r.record()["exact_match"], r.record()["completed"]
    (True, 1.0, 1.0)
    """

    def __init__(
        self,
        label: str,
        version: int,
        prompts: list,
        cfg: EvalConfig,
        sets: list[str] | None = None,
        seed: int = 0,
        clock=time.monotonic,
        episodes: bool = False,
    ):
        if not prompts:
            raise ValueError("prompts (0 given) must hold at least one prompt")
        if sets is not None and len(sets) != len(prompts):
            raise ValueError(f"sets ({len(sets)}) must name the set of each of the {len(prompts)} prompts")
        self.label, self.version, self.prompts, self.cfg = label, version, prompts, cfg
        self.episodes = episodes
        """The prompts are played as episodes of an environment (``environment.cls``): requests
        carry each prompt's row, answers each episode's environment reward."""
        self.sets = sets if sets is not None else [MAIN_SET] * len(prompts)
        self.chunk_size, self.max_new_tokens = cfg.chunk_prompts, cfg.max_new_tokens
        self.seeds = [prompt_seed(seed, p.prompt_uid) for p in prompts]
        self.num_chunks = -(-len(prompts) // self.chunk_size)
        self.todo = list(range(self.num_chunks))  # not offered yet (or to be offered again)
        self.out: dict[int, dict] = {}  # chunk -> {sent (monotonic), deadline, tries}
        self.tries: dict[int, int] = {}
        self.answered: dict[int, EvalResult] = {}  # chunk -> its answers, scored or being scored
        self.scored: dict[int, list[PromptScore]] = {}  # chunk -> its scorable prompts' scores
        self.versions: set[int] = set()
        self.generators: dict[str, int] = {}  # generator -> prompts it answered
        self.clock = clock
        self.started = clock()
        self.failed: str | None = None
        self.seconds = 0.0  # decoding seconds, summed over the generators

    def span(self, chunk: int) -> slice:
        return slice(chunk * self.chunk_size, (chunk + 1) * self.chunk_size)

    def chunk_prompts(self, chunk: int) -> list:
        return self.prompts[self.span(chunk)]

    def request(self, chunk: int) -> EvalRequest:
        """The ``eval_request`` of ``chunk``."""
        k = self.cfg.samples_k
        return EvalRequest(
            round=self.label,
            chunk=chunk,
            version=self.version,
            prompts=[p.text for p in self.chunk_prompts(chunk)],
            max_new_tokens=self.max_new_tokens,
            sent_at=time.time(),
            samples_k=k,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            seeds=self.seeds[self.span(chunk)] if k else [],
            rows=[
                {"answer": p.answer, "columns": p.columns, "prompt_uid": p.prompt_uid, "task": p.task}
                for p in self.chunk_prompts(chunk)
            ]
            if self.episodes
            else [],
        )

    def answer(self, body: EvalResult) -> float | None:
        """Take an ``eval_result``'s answers (to be scored: ``answers``, then ``score``); returns
        the request's round trip in seconds (None: a late, repeated or malformed answer, ignored)."""
        chunk = body.chunk
        if chunk in self.answered or not 0 <= chunk < self.num_chunks:
            return None
        n, k = len(self.chunk_prompts(chunk)), self.cfg.samples_k
        shapes = [len(body.texts), len(body.finish_reasons), len(body.samples), len(body.sample_finish_reasons)]
        want = [n, n, n if k else 0, n if k else 0]
        inner = [len(x) for x in body.samples + body.sample_finish_reasons]
        if self.episodes:  # each prompt's episodes' environment rewards and errors, greedy first
            shapes += [len(body.env_rewards), len(body.env_errors)]
            want += [n, n]
            inner += [len(x) - 1 for x in body.env_rewards + body.env_errors]
            figures = [body.turns, body.tool_calls, body.tool_errors]
            if any(figures):  # and their turns and tool calls (a generator that predates them: none)
                shapes += [len(x) for x in figures]
                want += [n, n, n]
                inner += [len(x) - 1 for x in body.turns + body.tool_calls + body.tool_errors]
        if shapes != want or any(m != k for m in inner):
            log.warning(
                "eval %s: chunk %d came back with %s answers (texts, finish reasons, samples, their finish "
                "reasons; episodes: rewards, errors, turns, tool calls, tool errors) for %d prompts and k = %d; "
                "ignored",
                self.label,
                chunk,
                shapes,
                n,
                k,
            )
            return None
        self.answered[chunk] = body
        self.versions.add(body.version)
        self.generators[body.generator] = self.generators.get(body.generator, 0) + n
        self.seconds += body.seconds
        sent = self.out.pop(chunk, None)
        if chunk in self.todo:
            self.todo.remove(chunk)
        return None if sent is None else self.clock() - sent["sent"]

    def answers(self, chunk: int) -> list[list[tuple[str, str]]]:
        """Each prompt's (text, finish reason) answers of an answered ``chunk``: greedy, then sampled."""
        body = self.answered[chunk]
        samples = body.samples or [[] for _ in body.texts]
        reasons = body.sample_finish_reasons or [[] for _ in body.texts]
        return [
            [(text, finish), *zip(texts, finishes)]
            for text, finish, texts, finishes in zip(body.texts, body.finish_reasons, samples, reasons)
        ]

    def played(self, chunk: int) -> list[list[tuple[float | None, str | None]]] | None:
        """Each prompt's episodes' (environment reward, environment error), greedy first, of an
        answered ``chunk``; None when the prompts were not played as episodes."""
        if not self.episodes:
            return None
        body = self.answered[chunk]
        return [list(zip(rewards, errors)) for rewards, errors in zip(body.env_rewards, body.env_errors)]

    def score(self, chunk: int, values: list[list[float | None] | None]) -> None:
        """Each prompt's reward values (greedy, then sampled; None: unscored), or None for a prompt
        its reward cannot score (no reference answer)."""
        answers, body = self.answers(chunk), self.answered[chunk]
        scores = []
        for index, (given, prompt_values, prompt_answers) in enumerate(zip(self.chunk_prompts(chunk), values, answers)):
            if prompt_values is None:
                continue
            ended = [finish == "stop" for _, finish in prompt_answers]
            score = PromptScore(
                given.task,
                self.sets[chunk * self.chunk_size + index],
                prompt_values[0],
                ended[0],
                list(prompt_values[1:]),
                ended[1:],
            )
            if self.episodes:
                score.env_failed = [error is not None for error in body.env_errors[index]]
                if body.turns:
                    score.turns = list(body.turns[index])
                    score.tool_calls = list(body.tool_calls[index])
                    score.tool_errors = list(body.tool_errors[index])
            scores.append(score)
        self.scored[chunk] = scores

    @property
    def done(self) -> bool:
        return self.failed is not None or len(self.scored) == self.num_chunks

    def record(self) -> dict:
        """What the run writes about this round (``evals.jsonl``, the console, TensorBoard): the
        figures of the task's own split at the top (``asyncrl.tasks.eval_metrics``); with prompts of
        several tasks (a mix), ``by_task`` holds each one's; with ``eval.sets``, ``sets`` each set's.
        Played as episodes, every one of them has the episode figures too."""
        k, at = self.cfg.samples_k, self.cfg.correct_at
        complete = len(self.scored) == self.num_chunks and self.failed is None
        scores = [s for chunk in sorted(self.scored) for s in self.scored[chunk]] if complete else []

        def figures(selected: list[PromptScore]) -> dict:
            return (
                round_metrics(selected, at, k, self.episodes)
                if complete and selected
                else empty_metrics(k, self.episodes)
            )

        main = [s for s in scores if s.eval_set == MAIN_SET]
        record = {
            "type": "eval",
            "label": self.label,
            "version": self.version,
            "versions": [min(self.versions), max(self.versions)] if self.versions else None,
            **figures(main),
            "num_prompts": self.sets.count(MAIN_SET),
            "generators": dict(sorted(self.generators.items())),
            "wall_s": self.clock() - self.started,
            "decode_s": self.seconds,
            "failed": self.failed,
        }
        tasks = sorted({p.task for p, s in zip(self.prompts, self.sets) if s == MAIN_SET})
        if len(tasks) > 1:
            record["by_task"] = {t: figures([s for s in main if s.task == t]) for t in tasks}
        names = list(dict.fromkeys(self.sets))
        if len(names) > 1:
            record["sets"] = {
                name: {**figures([s for s in scores if s.eval_set == name]), "num_prompts": self.sets.count(name)}
                for name in names
            }
        return record
