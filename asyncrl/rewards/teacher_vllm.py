"""``kind: teacher`` with ``engine: vllm``: the teacher's log-probabilities as vLLM prompt logprobs.

An offline ``vllm.LLM`` in the reward worker's process is given each sample's prompt + answer as
one prompt (``TokensPrompt``: the ids as the student sampled them) with ``prompt_logprobs=0`` and
``max_tokens=1``: for every position vLLM returns the log-probability of the token that is there,
under the model's own distribution (prompt logprobs skip the sampler, so temperature 1, which
``TeacherConfig`` requires), and the answer's positions are the teacher's log pi_T(y_t | x, y_<t).
The one token vLLM must sample is thrown away.

Why it is built so: a teacher on a GPU beside generators runs faster in the inference engine they
already use (paged attention, no padding, large batches) than in transformers, and its weights
load as the generators' do. Prefix caching is off: a cached prefix has no prompt logprobs to give.
Chunked prefill is off on vLLM's CPU backend, as the generators have it (``EngineConfig``). The
engine's settings are the few a teacher needs (dtype, max_model_len, KV cache), not the
generators' whole ``EngineConfig``: the reward worker imports no generator code.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np


class VLLMTeacher:
    """One offline vLLM engine on the teacher; ``logprobs`` scores (prompt, answer) id pairs."""

    def __init__(self, cfg):
        """``cfg``: the reward's ``TeacherConfig`` (not imported here: ``asyncrl.rewards.teacher`` imports this module)."""
        from vllm import LLM
        from vllm.platforms import current_platform

        self.cfg = cfg
        config = json.loads((Path(cfg.path) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.max_positions = cfg.max_model_len or int(config.get("max_position_embeddings", 2048))
        cpu = current_platform.is_cpu()
        self.llm = LLM(
            model=cfg.path,
            dtype="bfloat16" if cfg.dtype == "bf16" else "float32",
            max_model_len=self.max_positions,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=True,
            enable_prefix_caching=False,
            enable_chunked_prefill=False if cpu else None,
            max_num_seqs=max(cfg.batch_size, 1),
        )

    def logprobs(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Per (prompt ids, response ids): the (T,) teacher log-probabilities of the response."""
        from vllm import SamplingParams, TokensPrompt

        if not rows:
            return []
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in np.concatenate([p, r])]) for p, r in rows]
        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        out = []
        for (prompt, response), output in zip(rows, outputs):
            # prompt_logprobs[i]: {token id at i: Logprob} (None at position 0, which nothing predicts)
            positions = output.prompt_logprobs[len(prompt) : len(prompt) + len(response)]
            out.append(np.array([lp[int(t)].logprob for t, lp in zip(response, positions)], dtype=np.float32))
        return out

    def close(self) -> None:
        """Let the engine go (its KV cache and, in-process, its model) before the worker exits."""
        self.llm = None
        gc.collect()
