"""A thin wrapper around one in-process vLLM engine: sample groups, score, swap weights.

Why it is built this way:

- **One offline ``vllm.LLM`` per generator process.** The generator loop is synchronous
  (receive prompts, sample, send groups, maybe swap weights), so the offline engine is enough;
  scaling out means more generator processes, not a server. Everything vLLM-specific lives in
  this file so the rest of the system sees numpy arrays and plain strings.
- **A batch is sampled by exactly one policy version.** ``generate`` runs all prompts in one
  blocking ``LLM.generate`` call and ``load_weights`` only runs between calls, so every token of
  every returned group came from the weights of ``self.version``: a weight update is atomic per
  request, and the learner's importance ratios use the right behaviour policy. (To swap while
  requests run, ``weights.apply_mode: in_flight`` uses ``asyncrl.generators.engines.async_vllm_engine``.)
- **Behaviour logprobs, not model logprobs.** The engine is built with
  ``logprobs_mode="processed_logprobs"``: the logprob returned for each sampled token is taken
  from the distribution the sampler actually drew from, i.e.
  ``log_softmax(mask(logits / temperature))`` where ``mask`` sets the logits outside the top-k
  and then outside the top-p nucleus (both computed on the tempered logits) to -inf. With
  top_k=0 and top_p=1 that is ``log_softmax(logits / temperature)``; with them on, it is
  renormalised over the kept tokens (so it is >= the unmasked value). vLLM's default,
  ``raw_logprobs``, would return the temperature-1 model logprobs instead.
- **EOS is part of the response.** When a sample ends by EOS, vLLM keeps the EOS id in
  ``token_ids`` (with its logprob) and drops it from ``text``. ``response_ids`` keeps it too:
  the learner scores exactly ``prompt_ids + response_ids``, and the EOS decision must be trained.
- **Weights are swapped in place** with the worker's ``reload_weights`` (which, unlike calling
  ``model.load_weights`` twice, survives the CPU backend's weight repacking), followed by
  ``reset_prefix_cache``: without it, cached KV blocks computed by the old weights would be
  silently reused for prompts seen before.
- **Adapter-only updates** (``model.lora``): started with ``lora_rank``, the engine serves LoRA
  adapters (vLLM's ``enable_lora``); a version whose meta says ``adapter`` is loaded as a new
  adapter under a name and id never used before, and every later request runs on it
  (``asyncrl.generators.engines.lora``). The base weights stay; no prefix-cache reset is needed,
  as vLLM keys cached blocks by the adapter's name. With ``engine.lora_serving: merge`` (``auto``
  on the CPU backend) the adapter is merged into the base weights read from the model folder instead, and only the
  targeted matrices are reloaded (no LoRA kernels at each decode step).
- **No chunked prefill on the CPU backend** (``EngineConfig.enable_chunked_prefill``): requests
  are seeded, and vLLM's CPU backend dies when it splits a seeded request's prefill.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np
from safetensors import safe_open

from asyncrl.generators.completion import Completion
from asyncrl.generators.config import EngineConfig
from asyncrl.generators.engines.lora import (
    LIVE_ADAPTERS,
    AdapterSlots,
    AdapterSpec,
    FolderWeights,
    adapter_update,
    engine_lora_rank,
    merge_adapter,
    merges_adapters,
)
from asyncrl.generators.engines.tied_head import reload_weights
from asyncrl.generators.sampling import AnswerOptions, SamplingConfig, answer_params, greedy_params, sampling_params
from asyncrl.generators.sampling import derive_seed as derive_seed  # re-exported
from asyncrl.models.precision import resolve_engine_dtype

# The sampler reports logprobs of the distribution it sampled from (see the module docstring).
LOGPROBS_MODE = "processed_logprobs"
FINISH_REASONS = ("stop", "length")


def tokens_prompts(tokenizer, prompts: list[str], max_model_len: int) -> list:
    """Prompts -> vLLM ``TokensPrompt``s, refusing (ValueError naming it) a prompt that leaves no
    room to sample: vLLM must be able to sample at least one token after the prompt."""
    from vllm import TokensPrompt

    check_prompts(prompts)
    requests = []
    for index, prompt in enumerate(prompts):
        token_ids = list(tokenizer.encode(prompt))
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"prompts[{index}] has {len(token_ids)} tokens; it must have fewer than max_model_len ({max_model_len})"
            )
        requests.append(TokensPrompt(prompt_token_ids=token_ids))
    return requests


def engine_args(model_dir: str, cfg: EngineConfig, lora_rank: int | None = None) -> dict:
    """vLLM's engine arguments from an ``EngineConfig``, for the offline and the async engine alike;
    with ``lora_rank`` (``model.lora.rank``) vLLM serves LoRA adapters of up to that rank."""
    from vllm.platforms import current_platform

    chunked = cfg.enable_chunked_prefill
    if current_platform.is_cpu():
        if chunked:
            raise ValueError(
                "engine.enable_chunked_prefill (True) must be None or False on vLLM's CPU backend: a seeded "
                "request prefilled in chunks kills it ('CPU Generator does not use offset'; see the field)"
            )
        chunked = False
    lora = {}
    if lora_rank is not None:
        lora = dict(enable_lora=True, max_lora_rank=engine_lora_rank(lora_rank), max_loras=LIVE_ADAPTERS)
    return dict(
        **lora,
        model=str(model_dir),
        dtype=resolve_engine_dtype(cfg.dtype, cuda=not current_platform.is_cpu()),
        max_model_len=cfg.max_model_len,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        block_size=cfg.block_size,
        seed=cfg.seed,
        enable_chunked_prefill=chunked,  # None: vLLM's default
        logprobs_mode=LOGPROBS_MODE,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )


class VLLMEngine:
    """One vLLM engine in this process; see the module docstring for the guarantees."""

    def __init__(self, model_dir: str, cfg: EngineConfig, version: int = 0, lora_rank: int | None = None):
        from vllm import LLM  # imported here so that importing this module stays cheap

        self.cfg = cfg
        self.version = version
        """Learner step of the weights currently loaded."""
        self.base_version = 0
        """Version of the base weights (0: the model folder's): adapters must name it as theirs."""
        self._weight_names = read_weight_names(model_dir)
        self.merging = lora_rank is not None and merges_adapters(cfg.lora_serving)
        """Adapters are merged into the base weights (``engine.lora_serving: merge``), not served as adapters."""
        self._base = FolderWeights(model_dir) if self.merging else None
        self.adapters = AdapterSlots(make_request=make_lora_request) if lora_rank and not self.merging else None
        """The LoRA adapters loaded (None: started without ``lora_rank``, or merging them)."""
        self._llm = LLM(**engine_args(model_dir, cfg, None if self.merging else lora_rank))
        self.tokenizer = self._llm.get_tokenizer()
        """The engine's tokenizer (the one that produced ``Completion.prompt_ids``)."""

    # -----------------------------------------------------------------------------------------
    # sampling

    def generate(
        self, prompts: list[str], sampling: SamplingConfig, seed: int | list[int] | None = None
    ) -> list[list[Completion]]:
        """Sample ``sampling.n`` answers per prompt: one list of n completions per prompt, in order.

        With a ``seed`` the result is reproducible: a list gives each prompt its own (the generator
        passes ``sampling.request_seed`` of each group); an int gives each prompt one derived from
        ``(seed, prompt index)``, because vLLM gives a prompt's n children ``seed + child index``,
        so a shared seed would make every prompt's samples use the same noise.
        """
        requests = self.tokenize_prompts(prompts)
        params = sampling_params(sampling, len(prompts), seed)
        outputs = self._llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request())
        return [to_completions(output) for output in outputs]

    def greedy(self, prompts: list[str], max_tokens: int) -> list[str]:
        """Argmax-decode each prompt (for evaluation); returns the answer texts in prompt order."""
        outputs = self._llm.generate(
            self.tokenize_prompts(prompts), greedy_params(max_tokens), use_tqdm=False, lora_request=self.lora_request()
        )
        return [output.outputs[0].text for output in outputs]

    def answer(self, prompts: list[str], options: list[AnswerOptions]) -> list[list[tuple[str, str]]]:
        """Answer each prompt as its ``AnswerOptions`` say (for evaluation), in one batch: per
        prompt, its answers' (text, finish reason) in order."""
        params = [answer_params(o) for o in options]
        outputs = self._llm.generate(
            self.tokenize_prompts(prompts), params, use_tqdm=False, lora_request=self.lora_request()
        )
        return [[(c.text, c.finish_reason or "length") for c in output.outputs] for output in outputs]

    def tokenize_prompts(self, prompts: list[str]) -> list[dict]:
        """Prompts -> vLLM ``TokensPrompt``s, tokenized as vLLM would (special tokens added).

        Tokenizing here lets a too-long prompt fail with a ValueError that names it, before
        anything runs, instead of a vLLM error that aborts the whole batch.
        """
        return tokens_prompts(self.tokenizer, prompts, self.cfg.max_model_len)

    def score(self, prompt: str, continuation_ids: list[int]) -> np.ndarray:
        """(len(continuation_ids),) float32 temperature-1 logprobs the engine gives ``continuation_ids``
        after ``prompt``: a probe that the loaded weights are the ones we think."""
        request = ScoreRequest(self.tokenizer, prompt, continuation_ids, self.cfg.max_model_len)
        (output,) = self._llm.generate(
            [request.prompt()], request.params(), use_tqdm=False, lora_request=self.lora_request()
        )
        return request.logprobs(output)

    def lora_request(self):
        """The newest adapter's ``LoRARequest``, for every request from now on; None: the base weights."""
        newest = None if self.adapters is None else self.adapters.newest
        return None if newest is None else newest.request

    # -----------------------------------------------------------------------------------------
    # weights

    def load_weights(self, weights, version: int, adapter: dict | None = None) -> float:
        """Load new weights in place and serve them as ``version``; returns seconds.

        With ``adapter`` (the publication's ``meta["adapter"]``: ``AdapterSpec``) ``weights`` are
        a LoRA adapter's tensors (or a directory of them), loaded by ``load_adapter``.

        ``weights`` is a directory of safetensors (HF parameter names), or a list of
        ``(name, tensor)`` (a ``WeightUpdate``'s views of shared memory or received frames).
        Tensors go to the worker's ``reload_weights(weights_iterator=...)`` through
        ``collective_rpc`` with a callable, which runs in this process when the engine is
        in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); with a separate engine process
        vLLM would pickle the tensors as lists, so that case is refused (use the file transport).
        Call it between ``generate`` calls only: that is what makes an update atomic per batch.
        """
        if adapter is not None:
            return self.load_adapter(weights, version, AdapterSpec.from_meta(adapter))
        start = time.perf_counter()
        if isinstance(weights, (str, Path)):
            missing = self._weight_names - read_weight_names(weights)
            if missing:
                raise ValueError(f"{weights}: lacks {len(missing)} weights the model has, e.g. {sorted(missing)[:3]}")
            self._llm.collective_rpc(_reload_from_dir, args=(str(weights),))
            if not self._llm.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache failed: requests were still running during a weight update")
        else:
            named = list(weights)
            missing = self._weight_names - {name for name, _ in named}
            if missing:
                raise ValueError(
                    f"version {version}: lacks {len(missing)} weights the model has, e.g. {sorted(missing)[:3]}"
                )
            self._reload_tensors(named)
        if self.adapters is not None:  # new base weights: adapters of the old ones no longer apply
            for old in self.adapters.clear():
                self._llm.llm_engine.remove_lora(old.lora_id)
        self._base = None  # merging: the base is no longer the model folder's
        self.version = self.base_version = version
        return time.perf_counter() - start

    def _reload_tensors(self, named: list) -> None:
        """Copy ``(HF name, tensor)`` pairs into the model (all of its weights, or some) and drop
        the prefix cache, which holds KV computed by the old weights."""
        core = type(self._llm.llm_engine.engine_core).__name__
        if core != "InprocClient":
            raise NotImplementedError(
                f"loading tensors needs an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), not {core}; use weights.transport=file"
            )
        self._llm.collective_rpc(_reload_from_tensors, args=(named,))
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache failed: requests were still running during a weight update")

    def load_adapter(self, weights, version: int, spec: AdapterSpec) -> float:
        """Serve ``version``'s LoRA adapter (``(peft name, tensor)`` pairs, or a directory of
        safetensors holding them) to every request from now on; returns seconds.

        Written as a peft folder and loaded into vLLM (``add_lora``: a load that fails raises
        here, not in a later request) under a new name and id; the adapters before it are then
        unloaded, as no request runs between ``generate`` calls. With ``engine.lora_serving:
        merge`` it is merged into the base weights instead and the targeted matrices reloaded."""
        start = time.perf_counter()
        named = adapter_update(self, weights, version, spec)
        if self.merging:
            self._reload_tensors(merge_adapter(self._base, named, spec))
            self.version = version
            return time.perf_counter() - start
        served = self.adapters.add(named, spec, version)
        try:
            if not self._llm.llm_engine.add_lora(served.request):
                raise RuntimeError(f"vLLM did not load adapter {served.name} (version {version})")
        except BaseException:
            self.adapters.discard(served)
            raise
        self.adapters.commit(served)
        for old in self.adapters.retire():
            self._llm.llm_engine.remove_lora(old.lora_id)
        self.version = version
        return time.perf_counter() - start

    def close(self) -> None:
        """Shut the engine down and free its memory; the object is unusable afterwards."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        self._llm = None
        if self.adapters is not None:
            self.adapters.close()
        gc.collect()


# ---------------------------------------------------------------------------------------------
# helpers


def _reload_from_tensors(worker, named: list) -> None:
    """Runs on the vLLM worker (in this process): reload its model from ``(name, tensor)`` pairs."""
    reload_weights(worker, weights_iterator=iter(named))


def _reload_from_dir(worker, path: str) -> None:
    """Runs on the vLLM worker: reload its model from a directory of safetensors."""
    reload_weights(worker, weights_path=path)


def make_lora_request(name: str, lora_id: int, path: str):
    """vLLM's request for the adapter folder ``path``, loaded as ``name``/``lora_id``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)


def check_prompts(prompts: list[str]) -> None:
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"prompts ({prompts!r:.80}) must be a non-empty list of str")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompts[{index}] ({prompt!r}) must be a non-empty str")


class ScoreRequest:
    """The probe's request: the temperature-1 logprobs an engine gives ``continuation_ids`` after
    ``prompt``, checked to fit before anything runs (a ValueError naming the rule)."""

    def __init__(self, tokenizer, prompt: str, continuation_ids: list[int], max_model_len: int):
        if not continuation_ids:
            raise ValueError("continuation_ids must not be empty")
        self.prompt_ids = list(tokenizer.encode(prompt))
        if not self.prompt_ids:
            raise ValueError(f"prompt ({prompt!r}) must encode to at least one token")
        self.continuation_ids = [int(t) for t in continuation_ids]
        self.token_ids = self.prompt_ids + self.continuation_ids
        if len(self.token_ids) >= max_model_len:
            raise ValueError(
                f"prompt + continuation ({len(self.token_ids)} tokens) must be shorter than max_model_len ({max_model_len})"
            )

    def prompt(self):
        from vllm import TokensPrompt

        return TokensPrompt(prompt_token_ids=self.token_ids)

    def params(self, **extra):
        """Prompt logprobs skip the sampler, so they are the model's own (temperature 1) whatever
        the logprobs mode; max_tokens=1 because vLLM must sample at least one token."""
        from vllm import SamplingParams

        return SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, **extra)

    def logprobs(self, output) -> np.ndarray:
        """(len(continuation_ids),) float32 logprobs out of the engine's ``RequestOutput``."""
        per_position = output.prompt_logprobs[len(self.prompt_ids) :]
        return np.array([lp[t].logprob for t, lp in zip(self.continuation_ids, per_position)], dtype=np.float32)


def to_completions(output, finish_reasons: tuple[str, ...] = FINISH_REASONS) -> list[Completion]:
    """A vLLM ``RequestOutput`` -> its n completions, ordered by sample index; a finish reason
    outside ``finish_reasons`` is a RuntimeError (``abort`` only where the caller aborts)."""
    prompt_ids = np.asarray(output.prompt_token_ids, dtype=np.int32)
    completions = []
    for sample in sorted(output.outputs, key=lambda s: s.index):
        if sample.finish_reason not in finish_reasons:
            raise RuntimeError(
                f"request {output.request_id}: finish_reason ({sample.finish_reason!r}) must be one of {finish_reasons}"
            )
        token_ids = list(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
            raise RuntimeError(
                f"request {output.request_id}: got logprobs for {0 if sample.logprobs is None else len(sample.logprobs)} of {len(token_ids)} tokens"
            )
        logprobs = [position[token].logprob for token, position in zip(token_ids, sample.logprobs)]
        completions.append(
            Completion(
                prompt_ids=prompt_ids,
                response_ids=np.asarray(token_ids, dtype=np.int32),
                logprobs=np.asarray(logprobs, dtype=np.float32),
                text=sample.text,
                finish_reason=sample.finish_reason,
                version_segments=version_segments(sample),
            )
        )
    return completions


def version_segments(sample) -> list[list[int]] | None:
    """``[[first_token_index, version], ...]`` from vLLM's per-sample weight-version spans, or None
    when the engine labels no versions (the offline engine: its label stays ``"default"``)."""
    spans = [span for span in getattr(sample, "weight_versions", None) or [] if span.end > span.start]
    if not spans or not all(str(span.version).isdigit() for span in spans):
        return None
    return [[int(span.start), int(span.version)] for span in spans]


def read_weight_names(weights_dir: str | Path) -> set[str]:
    """Tensor names of every ``*.safetensors`` file in ``weights_dir`` (reads headers only)."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{weights_dir}: has no *.safetensors file")
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:  # "np" cannot open bfloat16 files
            names.update(f.keys())
    return names
