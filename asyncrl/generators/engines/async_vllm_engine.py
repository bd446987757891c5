"""vLLM's ``AsyncLLM`` behind the ``VLLMEngine`` interface, with weights swapped while requests run.

Why it is built this way:

- **Swap in flight** (``weights.apply_mode: in_flight``). A long generation need not hold a new
  version back: ``load_weights`` pauses the scheduler keeping every request
  (``pause_generation(mode="keep")``), reloads the weights, drops every cached KV block and
  resumes. Running requests are preempted by that reset and recompute their prompt and the
  tokens sampled so far with the new weights, so no KV of the old weights is ever reused; the
  tokens they sample next come from the new version.
- **Version segments.** The engine core stamps every step's output with its weight version
  (``update_weight_version``), and vLLM turns that into spans per sample; ``Completion.
  version_segments`` is ``[[first_token_index, version], ...]`` when a sample spans more than one
  version. Its oldest version is what staleness is measured from.
- **A synchronous face.** The generator loop stays synchronous: an event loop in a background
  thread runs the engine, ``generate``/``score``/``load_weights`` submit coroutines to it and
  wait. ``load_weights`` may therefore be called from another thread while ``generate`` waits
  (``asyncrl.generators.inflight``).
- **Interruptible requests** (partial rollouts, ``asyncrl.generators.resume``). One answer per
  request (``sample_request``), so that each can be aborted (``abort_requests``: it ends with
  what it sampled so far, finish reason ``abort``) and continued under the weights now loaded
  from its prompt + those tokens (``resume_request``), the tokens kept with their logprobs and
  versions. Which requests to abort, and when, is the generator loop's decision (the contract
  is in ``sample_request``).
- **The weights travel to the engine process without pickled tensors.** ``AsyncLLM`` runs its
  engine core in a child process; ``WeightLoaderExtension`` (a vLLM worker extension) maps
  shared-memory buckets itself (zero copy), or takes each bucket as raw bytes, or a directory.
- **Adapters are atomic per request** (``model.lora``: ``lora_rank``). A version that is a LoRA
  adapter is added without pausing anything: new requests take it, a running request keeps the
  adapter it started with to its end (so all its tokens carry that adapter's version, whatever
  vLLM's step labels say), and an older adapter is unloaded once no request holds it
  (``asyncrl.generators.engines.lora.AdapterSlots``). With ``engine.lora_serving: merge`` an
  adapter is merged into the base weights and swapped in as full weights are.
- **The engine core is forked** (``engine.core_start_method``). vLLM's CPU backend asks for spawn
  while it builds its config, and a spawned core imports vLLM again (~9 s on a 2-core host, for
  every engine started); the start method is set back after the config is built, before the core
  starts. vLLM itself still spawns where CUDA is initialised or inside a Ray actor. The core
  forked from a component watches it like any child (``asyncrl.fleet.process_tree``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
import os
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np

from asyncrl.generators.completion import Completion
from asyncrl.generators.engines.lora import (
    AdapterSlots,
    AdapterSpec,
    FolderWeights,
    adapter_update,
    merge_adapter,
    merges_adapters,
)
from asyncrl.generators.engines.tied_head import reload_weights
from asyncrl.generators.engines.vllm_engine import (
    FINISH_REASONS,
    EngineConfig,
    SamplingConfig,
    ScoreRequest,
    engine_args,
    greedy_params,
    make_lora_request,
    read_weight_names,
    sampling_params,
    to_completions,
    tokens_prompts,
)
from asyncrl.generators.resume import continuation_params, merge_continuation, oldest_version
from asyncrl.generators.sampling import AnswerOptions, answer_params

EXTENSION = "asyncrl.generators.engines.async_vllm_engine.WeightLoaderExtension"


class WeightLoaderExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): reloads weights sent by the generator.

    Each method ends in ``reload_weights(weights_iterator=...)``, which copies into the model's
    own tensors, so the buffers may go once it returns (``asyncrl.generators.engines.tied_head``: then
    a head tied to the embedding is re-packed)."""

    def asyncrl_load_shm(self, buckets: list[dict], version: int = 0) -> int:
        """``buckets``: ``[{path, nbytes, tensors}]`` of a shared-memory version (already verified).

        The mappings are kept for the next versions (``MappingCache``): the learner writes them
        into the same files, read again here without a page fault."""
        from asyncrl.weights.buckets import specs_from_wire, unpack
        from asyncrl.weights.mappings import MappingCache

        maps = getattr(self, "_asyncrl_maps", None)
        if maps is None:
            maps = self._asyncrl_maps = MappingCache()
        named = []
        try:
            for b in buckets:
                mm = maps.map(b["path"], int(b["nbytes"]), version)
                named.extend(unpack(_writable_view(mm), specs_from_wire(b["tensors"])))
            reload_weights(self, weights_iterator=iter(named))
        finally:
            del named
            maps.settle(version)
        return len(buckets)

    def asyncrl_load_bytes(self, buckets: list[list]) -> int:
        """``buckets``: ``[[data, tensors]]``, each bucket's packed bytes and its tensor specs."""
        from asyncrl.weights.buckets import specs_from_wire, unpack

        named = []
        for data, specs in buckets:
            named.extend(unpack(bytearray(data), specs_from_wire(specs)))
        reload_weights(self, weights_iterator=iter(named))
        return len(buckets)

    def asyncrl_load_dir(self, path: str) -> None:
        reload_weights(self, weights_path=path)


def _writable_view(mm: mmap.mmap):
    """torch.frombuffer wants a writable buffer; a read-only map is only ever read (copied from)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


class AsyncVLLMEngine:
    """One ``AsyncLLM`` driven from synchronous code; weights can change while it samples.

    Same interface as ``VLLMEngine`` (``generate``, ``greedy``, ``score``, ``load_weights``,
    ``close``, ``version``, ``tokenizer``)."""

    maps_shm = True
    """``load_weights`` takes a shared-memory version's bucket paths and maps them in the engine process."""

    def __init__(
        self,
        model_dir: str,
        cfg: EngineConfig,
        version: int = 0,
        timeout_s: float = 600.0,
        stat_loggers=None,
        lora_rank: int | None = None,
    ):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = cfg
        self.version = version
        """Learner step of the weights currently loaded (the newest, for requests still running)."""
        self.timeout_s = timeout_s
        """Seconds any one call into the engine may take before it is reported by name."""
        self._weight_names = read_weight_names(model_dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncrl-vllm-loop", daemon=True)
        self._thread.start()
        self._swap_lock = threading.Lock()  # one swap at a time, whichever thread asks
        self._running: dict[str, int] = {}  # request id -> oldest version it may hold (engine loop only)
        self.base_version = 0
        """Version of the base weights (0: the model folder's): adapters must name it as theirs."""
        self.merging = lora_rank is not None and merges_adapters(cfg.lora_serving)
        """Adapters are merged into the base weights (``engine.lora_serving: merge``), not served as adapters."""
        self._base = FolderWeights(model_dir) if self.merging else None
        self.adapters = AdapterSlots(make_request=make_lora_request) if lora_rank and not self.merging else None
        """The LoRA adapters loaded (None: started without ``lora_rank``, or merging them)."""
        lora = None if self.merging else lora_rank
        args = AsyncEngineArgs(**engine_args(model_dir, cfg, lora), worker_extension_cls=EXTENSION)

        async def build():  # stat_loggers: vLLM stat logger factories (asyncrl.generators.engines.vllm_stream)
            vllm_config = args.create_engine_config()  # where vLLM's CPU backend asks for spawn
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = cfg.core_start_method  # read as the core starts
            return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=stat_loggers)

        self._llm = self._call(build(), "the engine to start")
        self._call(self._llm.update_weight_version(str(version)), "the engine to take its weight version")
        self.tokenizer = self._llm.get_tokenizer()
        """The engine's tokenizer (the one that produced ``Completion.prompt_ids``)."""

    def _call(self, coro, what: str, timeout: float | None = None):
        """Run ``coro`` on the engine's loop and wait for it; a timeout names ``what`` it waited for."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        limit = self.timeout_s if timeout is None else timeout
        try:
            return future.result(limit)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"vLLM engine: waited {limit:.0f} s for {what}") from None

    # -----------------------------------------------------------------------------------------
    # sampling

    async def _one(self, prompt, params) -> object:
        final = None
        async for out in self._generate(prompt, params, uuid.uuid4().hex):
            final = out
        return final

    async def _generate(self, prompt, params, request_id: str):
        """vLLM's ``generate``, on the newest adapter where there is one, held until the request
        ends; its outputs' version labels then name that adapter's version, the only one that
        sampled them (vLLM's labels follow the engine's version, not the request's adapter)."""
        adapter = None if self.adapters is None else self.adapters.acquire()
        try:
            request = None if adapter is None else adapter.request
            async for out in self._llm.generate(prompt, params, request_id=request_id, lora_request=request):
                if adapter is not None:
                    label_adapter_version(out, adapter.version)
                yield out
        finally:
            if adapter is not None:
                self.adapters.release(adapter)
                await self._retire_adapters()

    async def _retire_adapters(self) -> None:
        for old in self.adapters.retire():
            await self._llm.remove_lora(old.lora_id)

    async def _many(self, prompts, params) -> list:
        return await asyncio.gather(*(self._one(p, sp) for p, sp in zip(prompts, params)))

    def generate(
        self, prompts: list[str], sampling: SamplingConfig, seed: int | list[int] | None = None
    ) -> list[list[Completion]]:
        """Sample ``sampling.n`` answers per prompt (see ``VLLMEngine.generate``); a sample that
        spans a weight update carries its ``version_segments``."""
        from vllm.sampling_params import RequestOutputKind

        requests = self.tokenize_prompts(prompts)
        # FINAL_ONLY: one message per request, every sample in it
        params = sampling_params(sampling, len(prompts), seed, output_kind=RequestOutputKind.FINAL_ONLY)
        outputs = self._call(self._many(requests, params), f"{len(prompts)} prompts to be sampled")
        return [to_completions(output) for output in outputs]

    def greedy(self, prompts: list[str], max_tokens: int) -> list[str]:
        """Argmax-decode each prompt; returns the answer texts in prompt order."""
        from vllm.sampling_params import RequestOutputKind

        params = greedy_params(max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
        requests = self.tokenize_prompts(prompts)
        outputs = self._call(self._many(requests, [params] * len(requests)), f"{len(prompts)} greedy answers")
        return [output.outputs[0].text for output in outputs]

    def answer(self, prompts: list[str], options: list[AnswerOptions]) -> list[list[tuple[str, str]]]:
        """Answer each prompt as its ``AnswerOptions`` say (see ``VLLMEngine.answer``)."""
        from vllm.sampling_params import RequestOutputKind

        params = [answer_params(o, output_kind=RequestOutputKind.FINAL_ONLY) for o in options]
        outputs = self._call(self._many(self.tokenize_prompts(prompts), params), f"{len(prompts)} evaluation answers")
        return [[(c.text, c.finish_reason or "length") for c in output.outputs] for output in outputs]

    def tokenize_prompts(self, prompts: list[str]) -> list[dict]:
        """Prompts -> ``TokensPrompt``s; a prompt that leaves no room to sample is a ValueError naming it."""
        return tokens_prompts(self.tokenizer, prompts, self.cfg.max_model_len)

    def score(self, prompt: str, continuation_ids: list[int]) -> np.ndarray:
        """Temperature-1 logprobs of ``continuation_ids`` after ``prompt`` (the probe; see ``VLLMEngine.score``)."""
        from vllm.sampling_params import RequestOutputKind

        request = ScoreRequest(self.tokenizer, prompt, continuation_ids, self.cfg.max_model_len)
        params = request.params(output_kind=RequestOutputKind.FINAL_ONLY)
        return request.logprobs(self._call(self._one(request.prompt(), params), "the probe to be scored"))

    # -----------------------------------------------------------------------------------------
    # interruptible requests: one answer each, aborted and resumed one by one

    def submit(self, coro) -> concurrent.futures.Future:
        """Schedule ``coro`` (``sample_request(...)``, ``resume_request(...)``) on the engine's
        loop; the caller bounds its wait (``future.result(timeout)``) and names what it waits for."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def sample_request(
        self, prompt_ids: list[int], params, request_id: str, oldest: int | None = None
    ) -> Completion:
        """Sample one answer after ``prompt_ids`` with vLLM ``params`` (``n`` must be 1; any
        output kind but DELTA) as request ``request_id``, on the engine's loop (``submit``).

        The contract for a generator loop that interrupts requests (partial rollouts):

        1. Run each answer as its own request: ``engine.submit(engine.sample_request(...))``.
        2. After ``load_weights(..., version)``, ``requests_older_than(version - max_staleness)``
           names the running requests whose oldest tokens would exceed the staleness bound;
           ``abort_requests(ids)`` ends them.
        3. An aborted request's coroutine returns its ``Completion`` with ``finish_reason ==
           "abort"``: the tokens, behaviour logprobs and ``version_segments`` sampled so far
           (possibly none). Submit ``resume_request(partial, params, new_id)`` with the
           *original* ``params``: it returns the whole answer (which may be aborted again, and
           resumed again), its ``resumed`` counting the interruptions.
        4. Nothing else returns ``abort``; a finished answer has ``stop`` or ``length``.

        ``oldest``: the oldest version the request's tokens may hold (a resumed prefix's);
        None: the version loaded now."""
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if params.n != 1 or params.output_kind == RequestOutputKind.DELTA:
            raise ValueError(f"request {request_id}: params must have n = 1 ({params.n}) and a cumulative output kind")
        submitted = self.version
        self._running[request_id] = submitted if oldest is None else min(oldest, submitted)
        final = None
        try:
            async for out in self._generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id):
                final = out
        finally:
            self._running.pop(request_id, None)
        if final is None:
            raise RuntimeError(f"request {request_id}: the engine returned no output")
        (completion,) = to_completions(final, FINISH_REASONS + ("abort",))
        if completion.version_segments is None and len(completion.response_ids):
            completion.version_segments = [[0, submitted]]  # an engine that labels no versions
        return completion

    async def resume_request(self, partial: Completion, params, request_id: str) -> Completion:
        """Continue the aborted answer ``partial`` under the weights loaded now: prompt + its
        tokens as the prompt, ``params.max_tokens`` less its length left to sample
        (``resume.continuation_params``), then merged (``resume.merge_continuation``: its tokens
        keep their logprobs and versions, the segments record the switch, the text is decoded
        from the merged ids). An answer with no room left (``max_tokens`` or ``max_model_len``
        reached) is returned whole, finish reason ``length``."""
        done = len(partial.response_ids)
        prompt = [int(t) for t in partial.prompt_ids]
        if done >= params.max_tokens or len(prompt) + done >= self.cfg.max_model_len:
            return replace(partial, finish_reason="length")
        prefix_version = oldest_version(partial, self.version)
        continuation = await self.sample_request(
            prompt + [int(t) for t in partial.response_ids],
            continuation_params(params, done),
            request_id,
            oldest=prefix_version,
        )
        merged = merge_continuation(partial, continuation, prefix_version, self.version)
        merged.text = self.tokenizer.decode(merged.response_ids.tolist(), skip_special_tokens=True)
        return merged

    def requests_older_than(self, version: int) -> list[str]:
        """Ids of running ``sample_request``/``resume_request`` requests that may hold tokens of a
        version older than ``version``: submitted under one (a lower bound on their first token's
        version, as a swap may come before it), or resuming a prefix that holds one."""

        async def older():
            return [rid for rid, oldest in self._running.items() if oldest < version]

        return self._call(older(), f"the requests older than version {version}")

    def abort_requests(self, request_ids: list[str]) -> None:
        """End ``request_ids`` now, from any thread: each one's coroutine returns what it sampled
        so far, finish reason ``abort``. Ids of requests already finished are ignored."""
        if request_ids:
            self._call(self._llm.abort(list(request_ids)), f"{len(request_ids)} requests to be aborted")

    # -----------------------------------------------------------------------------------------
    # streaming (continuous generation: asyncrl.generators.engines.vllm_stream submits with ``submit``)

    @property
    def llm(self):
        """The ``AsyncLLM`` (its ``vllm_config`` says how many KV blocks it has)."""
        return self._llm

    async def request(self, prompt, params):
        """The final ``RequestOutput`` of one request, n answers in it (a coroutine for ``submit``;
        cancelling its future aborts the request in the engine)."""
        return await self._one(prompt, params)

    async def sample_group(self, prompt_ids: list[int], params) -> list[Completion]:
        """The ``params.n`` answers of one request after ``prompt_ids`` (``FINAL_ONLY``: when all
        are done), as ``Completion``s (a coroutine for ``submit``)."""
        return to_completions(await self._one({"prompt_token_ids": list(prompt_ids)}, params))

    # -----------------------------------------------------------------------------------------
    # weights

    def load_weights(self, weights, version: int, shm: list[dict] | None = None, adapter: dict | None = None) -> float:
        """Swap in ``version`` while requests run; returns seconds (paused time included).

        ``weights``: a directory of safetensors, or ``(name, tensor)`` pairs; with ``shm`` (the
        buckets' ``{path, nbytes, tensors}``) the engine process maps them itself instead; with
        ``adapter`` (``meta["adapter"]``) they are a LoRA adapter's (``load_adapter``).
        Safe to call from any thread; swaps are serialised."""
        if adapter is not None:
            return self.load_adapter(weights, version, AdapterSpec.from_meta(adapter))
        start = time.perf_counter()
        if shm is not None:
            method, kwargs = "asyncrl_load_shm", {"buckets": shm, "version": version}
        elif isinstance(weights, (str, Path)):
            missing = self._weight_names - read_weight_names(weights)
            if missing:
                raise ValueError(f"{weights}: lacks {len(missing)} weights the model has, e.g. {sorted(missing)[:3]}")
            method, kwargs = "asyncrl_load_dir", {"path": str(weights)}
        else:
            method, kwargs = "asyncrl_load_bytes", {"buckets": _as_bytes(weights, version, self._weight_names)}
        with self._swap_lock:
            self._call(self._swap(method, kwargs, version), f"version {version} to be swapped in ({method})")
            if self.adapters is not None:  # new base weights: adapters of the old ones no longer apply
                for old in self.adapters.clear():
                    self._call(self._llm.remove_lora(old.lora_id), f"adapter {old.name} to be unloaded")
            self._base = None  # merging: the base is no longer the model folder's
            self.version = self.base_version = version
        return time.perf_counter() - start

    def load_adapter(self, weights, version: int, spec: AdapterSpec) -> float:
        """Serve ``version``'s LoRA adapter (``(peft name, tensor)`` pairs, or a directory of
        them) to new requests, without pausing those running; returns seconds. The engine
        process reads it from a peft folder (``AdapterSlots``); older adapters go once unused."""
        start = time.perf_counter()
        named = adapter_update(self, weights, version, spec)
        if self.merging:  # swapped like full weights (paused, prefix cache reset), the targeted matrices only
            kwargs = {"buckets": _as_bytes(merge_adapter(self._base, named, spec), version, set())}
            with self._swap_lock:
                self._call(self._swap("asyncrl_load_bytes", kwargs, version), f"version {version} to be merged in")
                self.version = version
            return time.perf_counter() - start
        with self._swap_lock:
            served = self.adapters.add(named, spec, version)
            try:
                if not self._call(self._llm.add_lora(served.request), f"adapter {served.name} to be loaded"):
                    raise RuntimeError(f"vLLM did not load adapter {served.name} (version {version})")
            except BaseException:
                self.adapters.discard(served)
                raise
            self.adapters.commit(served)
            self._call(self._retire_adapters(), "older adapters to be unloaded")
            self.version = version
        return time.perf_counter() - start

    async def _swap(self, method: str, kwargs: dict, version: int) -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._llm.collective_rpc(method, kwargs=kwargs)
            # Every cached block holds KV of the old weights: running requests are preempted and
            # recompute theirs with the new ones (a plain reset fails while they hold blocks).
            if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError(f"version {version}: reset_prefix_cache failed after the reload")
            await self._llm.update_weight_version(str(version))
        finally:
            await self._llm.resume_generation()

    def close(self) -> None:
        """Shut the engine and its loop down; the object is unusable afterwards."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if self.adapters is not None:
            self.adapters.close()


def label_adapter_version(output, version: int) -> None:
    """Label every token of a ``RequestOutput`` as sampled by ``version`` (its request's adapter)."""
    from vllm.outputs import WeightVersionSpan

    for sample in output.outputs:
        n = len(sample.token_ids)
        sample.weight_versions = [WeightVersionSpan(str(version), 0, n)] if n else None


def _as_bytes(named, version: int, expected: set[str]) -> list[list]:
    """``(name, tensor)`` pairs -> one packed bucket of bytes (the RPC carries bytes, not tensors)."""
    from asyncrl.weights.buckets import layout, pack_into, specs_to_wire

    named = list(named)
    missing = expected - {name for name, _ in named}
    if missing:
        raise ValueError(f"version {version}: lacks {len(missing)} weights the model has, e.g. {sorted(missing)[:3]}")
    specs, size = layout(named)
    buf = bytearray(max(size, 1))
    pack_into(named, specs, buf)
    return [[bytes(buf), specs_to_wire(specs)]]
