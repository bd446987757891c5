"""A simulated generator engine: the real control plane, driven by a timing model instead of a GPU.

``MockEngine`` has the ``VLLMEngine`` interface (``generate``, ``load_weights``, ``version``,
``close``) and sleeps for as long as a batched decoder would take, so the dispatcher, transport,
reward stage, buffer and learner loop all run for real while generators are simulated. Its
messages are real-sized: token ids and logprobs of the drawn lengths.

Timing model of one ``generate`` call over a batch (continuous batching within the call, like
vLLM: a sequence leaves the batch when it ends, the call returns when the longest ends):

    t = overhead_s + prefill_s_per_token · Σ prompt tokens
        + Σ_{step=1..max L} (decode_step_s + decode_s_per_seq · active sequences at that step)

Response lengths L are drawn per sample from a lognormal (median ``length_median``, shape
``length_sigma``) or from an empirical list, clipped to [1, sampling.max_tokens]: the long tail
is what makes synchronous RL wait for its slowest sample.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from asyncrl.generators.completion import Completion
from asyncrl.generators.config import MockEngineConfig
from asyncrl.generators.engines.lora import AdapterSpec, check_adapter
from asyncrl.generators.engines.vllm_engine import check_prompts
from asyncrl.generators.sampling import AnswerOptions, SamplingConfig


class MockEngine:
    """Simulated ``VLLMEngine``: same calls, sleeps per the timing model, fake but real-sized tokens.

    >>> e = MockEngine(MockEngineConfig(decode_step_s=0, overhead_s=0), seed=0)
    >>> [len(c) for c in e.generate(["1+1="], SamplingConfig(n=2, max_tokens=8))]
    [2]
    """

    def __init__(self, cfg: MockEngineConfig, seed: int = 0, version: int = 0):
        self.cfg = cfg
        self.version = version
        self.serves_adapter = False
        """Whether the version served is a LoRA adapter (a running request keeps its own to its end)."""
        self.rng = np.random.default_rng(seed)

    def draw_lengths(self, size: int, max_tokens: int) -> np.ndarray:
        if self.cfg.lengths is not None:
            lengths = self.rng.choice(np.asarray(self.cfg.lengths), size=size)
        else:
            lengths = np.round(self.cfg.length_median * np.exp(self.cfg.length_sigma * self.rng.standard_normal(size)))
        return np.clip(lengths, 1, max_tokens).astype(np.int64)

    def batch_seconds(self, prompt_tokens: int, lengths: np.ndarray) -> float:
        """Time of one call per the timing model (see the module docstring)."""
        steps = np.arange(1, int(lengths.max()) + 1)
        active = (lengths[None, :] >= steps[:, None]).sum(axis=1)  # (max L,) sequences still decoding
        decode = len(steps) * self.cfg.decode_step_s + self.cfg.decode_s_per_seq * float(active.sum())
        return self.cfg.overhead_s + self.cfg.prefill_s_per_token * prompt_tokens + decode

    def generate(
        self, prompts: list[str], sampling: SamplingConfig, seed: int | list[int] | None = None
    ) -> list[list[Completion]]:
        check_prompts(prompts)
        start = time.perf_counter()
        n = sampling.n
        lengths = self.draw_lengths(len(prompts) * n, sampling.max_tokens)
        prompt_tokens = sum(len(p) for p in prompts) * n
        out = [
            [self.completion(prompt, int(lengths[i * n + j]), sampling.max_tokens) for j in range(n)]
            for i, prompt in enumerate(prompts)
        ]
        time.sleep(max(0.0, self.batch_seconds(prompt_tokens, lengths) - (time.perf_counter() - start)))
        return out

    def completion(self, prompt: str, length: int, max_tokens: int) -> Completion:
        """One simulated answer of ``length`` tokens to ``prompt`` (right with chance ``accuracy``)."""
        return Completion(
            prompt_ids=np.frombuffer(prompt.encode(), dtype=np.uint8).astype(np.int32),
            response_ids=self.rng.integers(3, self.cfg.vocab_size, length, dtype=np.int32),
            logprobs=-self.rng.exponential(1.0, length).astype(np.float32),
            text=simulated_answer(prompt, self.rng.random() < self.cfg.accuracy),
            finish_reason="length" if length == max_tokens else "stop",
        )

    def greedy_length(self, max_tokens: int) -> int:
        """Tokens of a simulated greedy answer: the median length, within ``max_tokens``."""
        return min(max_tokens, max(1, round(self.cfg.length_median)))

    def greedy(self, prompts: list[str], max_tokens: int) -> list[str]:
        """Argmax answers: right when the simulated accuracy is at least one half; one decode step
        per token of the median length."""
        check_prompts(prompts)
        length = self.greedy_length(max_tokens)
        time.sleep(self.cfg.overhead_s + length * (self.cfg.decode_step_s + self.cfg.decode_s_per_seq * len(prompts)))
        return [simulated_answer(p, self.cfg.accuracy >= 0.5) for p in prompts]

    def answer(self, prompts: list[str], options: list[AnswerOptions]) -> list[list[tuple[str, str]]]:
        """Evaluation answers: a greedy one as ``greedy`` gives it (ended unless the median length
        reaches ``max_tokens``), sampled ones right with chance ``accuracy``, ended unless their
        drawn length reaches ``max_tokens``; one call's time as ``greedy``'s."""
        check_prompts(prompts)
        out = []
        for prompt, o in zip(prompts, options):
            if o.temperature == 0.0:
                ended = self.greedy_length(o.max_tokens) < o.max_tokens
                out.append([(simulated_answer(prompt, self.cfg.accuracy >= 0.5), "stop" if ended else "length")])
                continue
            lengths = self.draw_lengths(o.n, o.max_tokens)
            out.append(
                [
                    (
                        simulated_answer(prompt, self.rng.random() < self.cfg.accuracy),
                        "length" if n == o.max_tokens else "stop",
                    )
                    for n in lengths
                ]
            )
        length = self.greedy_length(max(o.max_tokens for o in options)) if options else 0
        time.sleep(self.cfg.overhead_s + length * (self.cfg.decode_step_s + self.cfg.decode_s_per_seq * len(out)))
        return out

    def load_weights(self, weights, version: int, adapter: dict | None = None) -> float:
        """``weights`` (a directory or ``(name, tensor)`` pairs) is ignored; sleeps, then serves ``version``.

        With ``adapter`` (``meta["adapter"]``) they are a LoRA adapter's, checked as a vLLM engine
        checks them (``asyncrl.generators.engines.lora.check_adapter``); requests running then
        keep the version they started with, as they keep their adapter in vLLM."""
        if adapter is not None:
            spec = AdapterSpec.from_meta(adapter)
            if not isinstance(weights, (str, Path)):
                check_adapter(list(weights), spec)
        time.sleep(self.cfg.load_weights_s)
        self.serves_adapter = adapter is not None
        self.version = version
        return self.cfg.load_weights_s

    def close(self) -> None:
        pass


_ADDITION = re.compile(r"^(\d+)\+(\d+)=$")


def simulated_answer(prompt: str, correct: bool) -> str:
    """The right (or a wrong) answer to an addition prompt; a wrong one for any other prompt."""
    match = _ADDITION.match(prompt)
    total = int(match.group(1)) + int(match.group(2)) if match else -1
    return str(total if correct and match else total + 1)
