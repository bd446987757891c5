"""Continuous batching on vLLM's ``AsyncLLM``: groups submitted one by one, each handed back when done.

``VLLMStream`` is the stream ``asyncrl.generators.schedulers.continuous`` drives (``submit``, ``finished``,
``abort``, ``running``, ``capacity``, ``kv_pressure``, ``until_next``) over an ``AsyncVLLMEngine``:

- **Each group is a rollout's coroutine** on the engine's event loop (single answers: one
  request of n samples, ``FINAL_ONLY``, ``asyncrl.generators.rollouts.single_turn``; multi-turn
  episodes and agent programs: one request per turn, ``submit_rollout``); when it ends it lands
  in a queue the generator's thread reads. vLLM's scheduler admits new requests between decode
  steps, so a group submitted while others run joins the running batch at once, and a short one
  leaves before a long one.
- **Abort** cancels the request's coroutine; vLLM's ``generate`` aborts the request in the engine
  when cancelled, freeing its KV blocks.
- **Answers apart** (``answers_apart``, for ``generator.partial_rollouts: resume``): each of the n
  answers is its own request instead, so that ``resume_older_than`` can abort one too stale and
  resume it under the weights now loaded (``asyncrl.generators.interrupt``).
- **What the engine reports** (``EngineLoad``, a vLLM stat logger): the running and waiting
  sequences after every step (running integrated over time, for occupancy = mean running /
  bound), the KV cache's use, and the KV pressure that shrinks the generator's bound: steps that
  end with sequences waiting while the cache is nearly full (``KV_FULL``). A sequence vLLM
  preempts for want of blocks goes back to its waiting queue at that step, so this is seen the
  step it happens; vLLM's own preemption count (``IterationStats.num_preempted_reqs``, kept as
  ``preempted``) arrives only with the preempted request's next token, seconds later under
  pressure, when the cache may have emptied (on the CPU backend with a 16-block cache, 8 of 39
  preemptions came with the cache under 75 % full), and it also counts an in-flight weight
  swap's (its prefix-cache reset sends every running request back to recompute, with the cache
  emptied: not pressure).
- **Capacity**: vLLM reports its KV blocks once started; a sequence of T tokens takes
  ceil(T / block_size) of them, so ``blocks // ceil(T / block_size)`` sequences of the expected
  length T fit (T = ``max_model_len``: every one may reach it), at most ``max_num_seqs``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future

from asyncrl.generators.completion import Completion
from asyncrl.generators.engines.async_vllm_engine import AsyncVLLMEngine
from asyncrl.generators.engines.vllm_engine import (
    EngineConfig,
    SamplingConfig,
    greedy_params,
    sampling_params,
)
from asyncrl.generators.rollouts.single_turn import SingleTurn

KV_FULL = 0.9
"""KV cache use at or above which sequences waiting in the engine are counted as KV pressure."""


class EngineLoad:
    """What the engine reports after each step, kept for the generator (thread-safe reads).

    ``factory`` is handed to ``AsyncLLM`` as a stat logger factory; vLLM calls ``record`` from its
    output handler, on the engine's event loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self.running = 0
        """Sequences the scheduler ran at the last step."""
        self.waiting = 0
        """Sequences waiting in the engine after the last step (preempted, or not admitted yet)."""
        self.kv_usage = 0.0
        """Fraction of the KV cache in use at the last step."""
        self.pressure = 0
        """Steps that ended with sequences waiting and the KV cache at least ``KV_FULL`` full, since the start."""
        self.preempted = 0
        """Every preemption the engine reported (weight swaps' included), since the start; each is
        reported with the preempted request's next output, not when it happens."""
        self.generated_tokens = 0
        """Tokens the engine generated since the start."""
        self._at = time.monotonic()
        self._area = 0.0

    def factory(self, vllm_config, engine_index: int = 0):
        """vLLM's ``StatLoggerFactory``: a logger that records into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        load = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                load.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self):
                pass

        return _Recorder(vllm_config, engine_index)

    def record(self, scheduler_stats, iteration_stats) -> None:
        now = time.monotonic()
        with self._lock:
            self._area += self.running * (now - self._at)
            self._at = now
            if scheduler_stats is not None:
                self.running = scheduler_stats.num_running_reqs
                self.waiting = scheduler_stats.num_waiting_reqs
                self.kv_usage = scheduler_stats.kv_cache_usage
                if self.waiting and self.kv_usage >= KV_FULL:
                    self.pressure += 1
            if iteration_stats is not None:
                self.generated_tokens += iteration_stats.num_generation_tokens
                self.preempted += iteration_stats.num_preempted_reqs

    def sequence_seconds(self) -> float:
        """∫ running sequences dt since the start (mean running over a window = its growth / the window)."""
        with self._lock:
            return self._area + self.running * (time.monotonic() - self._at)


def build_stream(
    model_dir: str, cfg: EngineConfig, timeout_s: float = 600.0, lora_rank: int | None = None
) -> VLLMStream:
    """An ``AsyncVLLMEngine`` that reports its load (serving LoRA adapters of up to ``lora_rank``,
    ``model.lora.rank``), and the stream over it."""
    load = EngineLoad()
    engine = AsyncVLLMEngine(model_dir, cfg, timeout_s=timeout_s, stat_loggers=[load.factory], lora_rank=lora_rank)
    return VLLMStream(engine, load)


class VLLMStream:
    """Groups in and out of an ``AsyncVLLMEngine`` one at a time (see the module docstring).

    With a vLLM engine (so not a doctest; tests/generators/engines/test_vllm_stream.py runs it)::

        stream = build_stream(model_dir, EngineConfig(max_model_len=640))
        stream.submit("g0", "12+34=", SamplingConfig(n=8, max_tokens=32))
        stream.finished(timeout=60)  # [('g0', [Completion(...), ...], None)]
    """

    def __init__(self, engine: AsyncVLLMEngine, load: EngineLoad | None = None):
        self.engine = engine
        self.load = load or EngineLoad()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Future] = {}
        self._sequences: dict[str, int] = {}
        self.answers_apart = False
        """Each answer its own request, resumable (``resume_older_than``); set before the first ``submit``."""

    @property
    def running(self) -> int:
        """Sequences submitted and not yet handed back (n per group, its greedy answer included)."""
        return sum(self._sequences.values())

    def capacity(self, expected_tokens: int | None = None) -> int | None:
        """Sequences of ``expected_tokens`` (None: ``max_model_len``) the KV cache holds, at most
        ``max_num_seqs``; None when the engine reports no blocks."""
        cache = self.engine.llm.vllm_config.cache_config
        if not cache.num_gpu_blocks or not cache.block_size:
            return None
        cfg = self.engine.cfg
        tokens = min(expected_tokens or cfg.max_model_len, cfg.max_model_len)
        blocks_each = -(-tokens // cache.block_size)
        return max(1, min(cfg.max_num_seqs, cache.num_gpu_blocks // blocks_each))

    def kv_pressure(self) -> int:
        """Running count of the engine's KV-pressure signals (``EngineLoad.pressure``)."""
        return self.load.pressure

    def submit(
        self,
        key: str,
        prompt: str,
        sampling: SamplingConfig,
        seed: int | None = None,
        greedy_tokens: int | None = None,
        **extra,
    ) -> None:
        """Start ``sampling.n`` samples of ``prompt`` under ``key`` (the single-turn rollout,
        ``asyncrl.generators.rollouts.single_turn``), and its greedy answer of up to
        ``greedy_tokens``; ``extra`` goes to vLLM's ``SamplingParams`` (e.g. ``min_tokens``,
        ``ignore_eos``). A prompt that leaves no room to sample is a ValueError naming it."""
        from vllm.sampling_params import RequestOutputKind

        (tokens,) = self.engine.tokenize_prompts([prompt])
        (params,) = sampling_params(sampling, 1, seed, output_kind=RequestOutputKind.FINAL_ONLY, **extra)
        greedy = None
        if greedy_tokens is not None:
            greedy = greedy_params(greedy_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
        rollout = SingleTurn(self.engine, sampling, params, self.answers_apart)
        prompt_ids = list(tokens["prompt_token_ids"])
        self._start(key, rollout.sample(key, None, prompt_ids, seed), sampling.n, prompt_ids, greedy)

    def submit_rollout(self, key: str, row, rollout, seed: int) -> None:
        """Start ``rollout``'s group of ``row`` under ``key`` (``asyncrl.generators.rollouts.base``:
        multi-turn episodes, agent programs); its samples come back from ``finished`` like a
        single-turn group's answers."""
        (tokens,) = self.engine.tokenize_prompts([row["text"]])
        self._start(key, rollout.sample(key, row, list(tokens["prompt_token_ids"]), seed), rollout.sampling.n)

    def _start(self, key: str, samples, sequences: int, prompt_ids=None, greedy=None) -> None:
        if key in self._requests:
            samples.close()  # never awaited
            raise ValueError(f"request {key!r} is already running: keys must be unique")
        self._requests[key] = self.engine.submit(self._run(key, samples, prompt_ids, greedy))
        self._sequences[key] = sequences + (greedy is not None)

    async def _run(self, key: str, samples, prompt_ids, greedy) -> None:
        try:
            if greedy is None:
                self._done.put((key, await samples, None, None))
                return
            completions, out = await asyncio.gather(
                samples, self.engine.request({"prompt_token_ids": prompt_ids}, greedy)
            )
            self._done.put((key, completions, out.outputs[0].text, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the generator's thread by finished(): never swallowed
            self._done.put((key, None, None, e))

    def resume_older_than(self, version: int) -> int:
        """Abort every running answer that may hold tokens older than ``version`` (``answers_apart``
        only); each is resumed under the weights loaded now by its own coroutine. Returns how many."""
        ids = self.engine.requests_older_than(version)
        self.engine.abort_requests(ids)
        return len(ids)

    def finished(self, timeout: float) -> list[tuple[str, list[Completion], str | None]]:
        """``(key, n completions, greedy text or None)`` of each group done, waiting up to
        ``timeout`` s for the first; a request that failed raises here, naming its key."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                wait = max(0.0, deadline - time.monotonic()) if not out else 0.0
                item = self._done.get(timeout=wait) if wait > 0 else self._done.get_nowait()
            except queue.Empty:
                return out
            key, completions, greedy, error = item
            if self._requests.pop(key, None) is None:
                continue  # aborted meanwhile
            self._sequences.pop(key, None)
            if error is not None:
                raise RuntimeError(f"vLLM engine: request {key!r} failed: {type(error).__name__}: {error}") from error
            out.append((key, completions, greedy))

    def until_next(self, limit: float) -> float:
        """0 when a group is done and waiting, else ``limit`` (vLLM does not say when one will be)."""
        return 0.0 if not self._done.empty() else limit

    def abort(self, keys) -> None:
        """Stop the requests of ``keys`` (unknown or finished ones are ignored); vLLM frees their KV."""
        for key in keys:
            future = self._requests.pop(key, None)
            self._sequences.pop(key, None)
            if future is not None:
                future.cancel()

    def close(self) -> None:
        self.abort(list(self._requests))
        self.engine.close()
