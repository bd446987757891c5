"""Continuous batching on the simulated engine: requests join and leave a running batch in simulated time.

``MockStream`` is what ``asyncrl.generators.engines.vllm_stream.VLLMStream`` is to vLLM's ``AsyncLLM``,
for ``MockEngine``: requests are submitted one group at a time and each is returned the moment
its n sequences (and its greedy answer, if asked) are done, so a short group overtakes a long one
submitted with it. Time follows ``MockEngine``'s model, with sequences joining between steps:

    one decode step = decode_step_s + decode_s_per_seq · sequences running at that step
    a submission first costs overhead_s + prefill_s_per_token · prompt tokens · n

No thread runs it: each call advances a simulated clock to the wall clock (between two events the
running set is constant, so it moves one event at a time), and ``finished`` sleeps until the next
group is due. A weight version loaded while sequences run (``MockEngine.load_weights``, from the
in-flight applier's thread) starts a new version segment in each of them at the token it reached,
as vLLM's per-step version labels do (a LoRA adapter's version only for sequences submitted after
it: a running one keeps its adapter). ``resume_older_than`` aborts and resumes answers as
``AsyncVLLMEngine.resume_request`` does (partial rollouts): an answer keeps its tokens and segments,
pays a prefill of its prompt and tokens, and counts the interruption (``Completion.resumed``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncrl.generators.completion import Completion
from asyncrl.generators.engines.mock_engine import MockEngine, simulated_answer
from asyncrl.generators.engines.vllm_engine import check_prompts
from asyncrl.generators.sampling import SamplingConfig


@dataclass
class _Sequence:
    key: str
    length: int
    """Tokens it will have when done."""
    done: int = 0
    """Tokens sampled so far."""
    segments: list[list[int]] = field(default_factory=list)
    """``[[first_token_index, version], ...]``."""
    resumed: int = 0
    """Times it was aborted and resumed (``resume_older_than``)."""


@dataclass
class _Request:
    prompt: str
    max_tokens: int
    sequences: list[_Sequence]
    greedy: _Sequence | None
    left: int
    """Sequences not yet done."""


class MockStream:
    """Submit groups to a ``MockEngine`` and take each back as soon as it is done (module docstring).

    >>> from asyncrl.generators.engines.mock_engine import MockEngineConfig
    >>> stream = MockStream(MockEngine(MockEngineConfig(lengths=[2], decode_step_s=0.001), seed=0))
    >>> stream.submit("g0", "1+1=", SamplingConfig(n=2, max_tokens=4))
    >>> [(key, len(comps)) for key, comps, _greedy in stream.finished(timeout=1.0)]
    [('g0', 2)]
    """

    def __init__(self, engine: MockEngine):
        self.engine = engine
        self.cfg = engine.cfg
        self.clock = time.monotonic()
        """Simulated time the running batch has reached (never ahead of the wall clock)."""
        self.version = engine.version
        self.requests: dict[str, _Request] = {}
        self.active: list[_Sequence] = []
        self.done: list[str] = []
        self.occupancy_s = 0.0
        """∫ running sequences dt over the simulated time (occupancy = this / (bound · wall))."""

    @property
    def running(self) -> int:
        """Sequences submitted and not yet handed back (running, or done in a group still running)."""
        return sum(len(r.sequences) + (r.greedy is not None) for r in self.requests.values())

    def capacity(self, expected_tokens: int) -> int | None:
        """The engine's own bound on sequences: None, the simulated engine has no KV cache."""
        return None

    def kv_pressure(self) -> int:
        """Running count of the engine's KV-pressure signals: none, the simulated engine has no KV cache."""
        return 0

    def submit(self, key: str, prompt: str, sampling: SamplingConfig, seed: int | None = None, greedy_tokens=None):
        """Start ``sampling.n`` sequences of ``prompt`` (and a greedy one of up to ``greedy_tokens``)
        under ``key``; ``seed`` is unused (the engine's generator draws the lengths)."""
        check_prompts([prompt])
        if key in self.requests:
            raise ValueError(f"request {key!r} is already running: keys must be unique")
        self.advance()
        n, version = sampling.n, self.engine.version
        lengths = self.engine.draw_lengths(n, sampling.max_tokens)
        sequences = [_Sequence(key, int(length), segments=[[0, version]]) for length in lengths]
        greedy = None
        if greedy_tokens is not None:
            greedy = _Sequence(key, self.engine.greedy_length(greedy_tokens), segments=[[0, version]])
        self.requests[key] = _Request(prompt, sampling.max_tokens, sequences, greedy, n + (greedy is not None))
        self.active.extend(sequences + ([greedy] if greedy else []))
        # The prefill delays the whole batch: the clock moves past the wall clock by its cost.
        self.clock = max(self.clock, time.monotonic()) + self.cfg.overhead_s
        self.clock += self.cfg.prefill_s_per_token * len(prompt) * n

    def abort(self, keys) -> None:
        """Stop the requests of ``keys`` (unknown or finished ones are ignored)."""
        self.advance()
        gone = {k for k in keys if self.requests.pop(k, None) is not None}
        self.active = [s for s in self.active if s.key not in gone]
        self.done = [k for k in self.done if k not in gone]

    def resume_older_than(self, version: int) -> int:
        """Abort and resume, from its tokens so far, each running answer whose oldest token is older
        than ``version`` (not the greedy ones: no loss is taken on them); its next tokens are the
        version loaded now's, and its prefill of prompt + tokens delays the batch as a submission's
        does. Returns how many."""
        self.advance()  # label the tokens up to now first
        stale = [s for s in self.active if s.segments[0][1] < version and s is not self.requests[s.key].greedy]
        for s in stale:
            s.resumed += 1
        if stale:  # one prefill of every resumed answer's prompt + tokens, as one engine step
            tokens = sum(len(self.requests[s.key].prompt) + s.done for s in stale)
            self.clock = max(self.clock, time.monotonic()) + self.cfg.overhead_s + self.cfg.prefill_s_per_token * tokens
        return len(stale)

    def finished(self, timeout: float) -> list[tuple[str, list[Completion], str | None]]:
        """``(key, n completions, greedy text or None)`` of each group done, waiting up to
        ``timeout`` s for the first."""
        deadline = time.monotonic() + timeout
        self.advance()
        while not self.done and (now := time.monotonic()) < deadline:
            time.sleep(max(0.0, min(deadline, self.next_done_at()) - now))
            self.advance()
        out = [self._group(key) for key in self.done]
        self.done = []
        return out

    def until_next(self, limit: float) -> float:
        """Seconds until the next sequence ends, at most ``limit`` (the loop waits that long elsewhere)."""
        self.advance()
        if self.done:
            return 0.0
        return max(0.0, min(limit, self.next_done_at() - time.monotonic())) if self.active else limit

    def next_done_at(self) -> float:
        """Wall-clock time at which the next running sequence ends (inf when none runs)."""
        if not self.active:
            return float("inf")
        left = min(s.length - s.done for s in self.active)
        return self.clock + left * self.step_s(len(self.active))

    def step_s(self, running: int) -> float:
        return self.cfg.decode_step_s + self.cfg.decode_s_per_seq * running

    def advance(self) -> None:
        """Move the simulated batch to the wall clock, one event (a sequence ending) at a time."""
        now = time.monotonic()
        while self.active and self.clock < now:
            step = self.step_s(len(self.active))
            left = min(s.length - s.done for s in self.active)
            steps = min(left, int((now - self.clock) / step + 1e-6)) if step > 0 else left
            if steps <= 0:
                break
            self.clock += steps * step
            self.occupancy_s += steps * step * len(self.active)
            for s in self.active:
                s.done += steps
            ended = [s for s in self.active if s.done >= s.length]
            self.active = [s for s in self.active if s.done < s.length]
            for s in ended:
                request = self.requests[s.key]
                request.left -= 1
                if request.left == 0:
                    self.done.append(s.key)
        if not self.active:
            self.clock = max(self.clock, now)
        # Swapped in flight (noticed now: the tokens up to here are labelled with the older version,
        # so staleness is never understated): what runs from here on is the new version's. A LoRA
        # adapter changes no running sequence: each keeps the adapter it started with.
        if self.engine.version != self.version:
            self.version = self.engine.version
            for s in [] if self.engine.serves_adapter else self.active:
                if s.segments[-1][0] == s.done:
                    s.segments[-1][1] = self.version
                else:
                    s.segments.append([s.done, self.version])

    def _group(self, key: str) -> tuple[str, list[Completion], str | None]:
        request = self.requests.pop(key)
        completions = []
        for s in request.sequences:
            completion = self.engine.completion(request.prompt, s.length, request.max_tokens)
            completion.version_segments = s.segments
            completion.resumed = s.resumed
            completions.append(completion)
        greedy = None
        if request.greedy is not None:
            greedy = simulated_answer(request.prompt, self.cfg.accuracy >= 0.5)
        return key, completions, greedy
