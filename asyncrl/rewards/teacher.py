"""``kind: teacher``: a teacher model scores the student's own samples, token by token.

On-policy distillation (Agarwal et al. 2024, GKD; Gu et al. 2024, MiniLLM) trains the student on
its own samples y ~ mu (the behaviour policy) towards a teacher pi_T by the per-token reverse KL
log mu(y_t | y_<t) - log pi_T(y_t | y_<t). The learner (``asyncrl.learner.distill``) needs, for
every sampled token, log pi_T(y_t | x, y_<t); computing it is a forward pass of the teacher over
the prompt and the answer, which is what a reward model does, so the teacher lives where reward
models live: in the reward stage, as one more reward of ``reward.rewards``. Its result is not a
reward but ``TeacherLogprobs``, which ``rewards.base.combine`` writes into
``Sample.teacher_logprobs`` (the scalar reward is the other rewards' sum, untouched) and which
travels to the buffer and the learner with the sample.

The teacher's failures are a reward's: a group the teacher does not score within ``timeout_s``
(the wait for the model, behind other groups, included) is ``Unscored("teacher_timeout")``; a
forward pass that raises is ``Unscored("teacher_error")``; a token id the teacher's vocabulary
does not hold is ``Unscored("teacher_vocab")``; non-finite log-probabilities ``nonfinite_score``.
The group is then dropped by the buffer under ``reward_failed: teacher: REASON`` (or scored
again, ``reward.on_failure: requeue``), counted per reason, never trained on without its
teacher's signal.

The teacher scores token ids, not text: it must share the student's tokenizer (the same ids mean
the same tokens), as the references require (GKD and MiniLLM distil within one model family).
Its logits are divided by ``temperature`` (1: the teacher's own distribution, as GKD and MiniLLM
use). ``engine: hf`` runs a Hugging Face causal LM in a thread of the reward worker, one forward
pass at a time (a model is not re-entrant and two on 2 cores would only contend), in batches of
``batch_size`` samples. A forward pass cannot be interrupted: one that outlives its group's
``timeout_s`` runs on to its end while its group is already unscored, and the groups waiting
behind it time out in their turn (each counted), so a wedged teacher is loud, never silent.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config
from asyncrl.rewards.base import RewardResult, TeacherLogprobs
from asyncrl.rewards.unscored import Unscored
from asyncrl.wire.schema import Group, sample_prompt_ids

log = logging.getLogger(__name__)


class TeacherConfig(Config):
    """Options of ``kind: teacher``."""

    path: str
    """Hugging Face causal-LM directory of the teacher; it must share the student's tokenizer (ids are scored as they are). Relative to the working directory; written absolute into the resolved config."""
    engine: Literal["hf", "vllm"] = "hf"
    """hf: transformers in the reward worker's process (a thread, one forward pass at a time); vllm: an
    offline vLLM engine there, the answers scored as prompt log-probabilities (``asyncrl.rewards.teacher_vllm``)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the teacher's weights; hf takes its log-probabilities in float32 either way."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + answer the teacher scores (a longer one is unscored, teacher_too_long); None: the model's max_position_embeddings."""
    kv_cache_memory_bytes: int | None = Field(256 << 20, ge=1)
    """vllm: the engine's KV cache in bytes; None sizes it from gpu_memory_utilization (GPU only)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """vllm: the fraction of GPU memory the engine may take, when kv_cache_memory_bytes is None."""
    batch_size: int = Field(16, ge=1)
    """Samples per forward pass."""
    timeout_s: float = Field(30.0, gt=0)
    """Seconds a group's scoring may take, the wait for the model included; past it the group is unscored (teacher_timeout)."""
    temperature: float = Field(1.0, gt=0)
    """The teacher's logits are divided by it (1: its own distribution)."""
    device: str = "cpu"
    """Torch device of the teacher."""

    @model_validator(mode="after")
    def check_engine(self) -> TeacherConfig:
        if self.engine == "vllm" and self.temperature != 1.0:
            raise ValueError(
                f"temperature ({self.temperature}) must be 1 with engine vllm: its prompt log-probabilities "
                "are the model's own distribution"
            )
        return self

    @field_validator("path")
    @classmethod
    def absolute(cls, value: str) -> str:
        """Absolute, so that every reward worker (and the resolved config) names the same folder."""
        return str(Path(value).expanduser().absolute())


def token_logprobs(logits, input_ids, temperature: float = 1.0):
    """log softmax(logits[b, t] / temperature)[input_ids[b, t + 1]]: (B, L, V), (B, L) -> (B, L-1), float32."""
    import torch

    logits = logits[:, :-1].float()  # (B, L-1, V)
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].long().unsqueeze(-1)  # (B, L-1, 1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class HFTeacher:
    """``engine: hf``: a transformers causal LM, right-padded batches of ``batch_size`` sequences."""

    def __init__(self, cfg: TeacherConfig):
        import torch
        from transformers import AutoModelForCausalLM

        self.cfg, self.torch = cfg, torch
        dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype).to(cfg.device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_positions = cfg.max_model_len or getattr(self.model.config, "max_position_embeddings", None)

    def logprobs(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Per (prompt ids, response ids): the (T,) teacher log-probabilities of the response."""
        torch, device = self.torch, self.cfg.device
        out: list[np.ndarray] = []
        with torch.inference_mode():
            for start in range(0, len(rows), self.cfg.batch_size):
                chunk = rows[start : start + self.cfg.batch_size]
                length = max(max(len(p) + len(r) for p, r in chunk), 2)
                ids = torch.zeros((len(chunk), length), dtype=torch.long)  # right-padded with id 0
                attention = torch.zeros((len(chunk), length), dtype=torch.long)
                for b, (prompt, response) in enumerate(chunk):
                    seq = np.concatenate([prompt, response]).astype(np.int64)
                    ids[b, : len(seq)] = torch.from_numpy(seq)
                    attention[b, : len(seq)] = 1
                logits = self.model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
                logprobs = token_logprobs(logits, ids.to(device), self.cfg.temperature).cpu()  # (b, L-1)
                for b, (prompt, response) in enumerate(chunk):
                    P, T = len(prompt), len(response)
                    out.append(logprobs[b, P - 1 : P - 1 + T].numpy().astype(np.float32))  # predicted from P-1..
        return out


class TeacherReward:
    """log pi_T of every answer token of a group, by the teacher ``TeacherConfig`` names."""

    per_sample = True  # a sample's teacher logprobs do not depend on the other samples

    def __init__(self, name: str, cfg: TeacherConfig):
        self.name, self.cfg = name, cfg
        if cfg.engine == "vllm":
            from asyncrl.rewards.teacher_vllm import VLLMTeacher

            self.backend = VLLMTeacher(cfg)
        else:
            self.backend = HFTeacher(cfg)
        self.vocab_size, self.max_positions = self.backend.vocab_size, self.backend.max_positions
        self._lock = threading.Lock()
        self.failures = 0

    def score_sequences(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Per (prompt ids, response ids): the (T,) teacher log-probabilities of the response, one call at a time."""
        with self._lock:
            return self.backend.logprobs(rows)

    def check(self, group: Group) -> list[Unscored | None]:
        """Per sample, why the teacher cannot score it (ids outside its vocabulary, too long), or None."""
        reasons: list[Unscored | None] = []
        for s in group.samples:
            prompt = sample_prompt_ids(group, s)
            top = max(int(prompt.max(initial=0)), int(s.response_ids.max(initial=0)))
            if len(prompt) == 0:
                reasons.append(Unscored("teacher_error", "the prompt is empty: the first token has no context"))
            elif top >= self.vocab_size:
                reasons.append(
                    Unscored("teacher_vocab", f"token id {top} >= the teacher's vocabulary ({self.vocab_size})")
                )
            elif self.max_positions and len(prompt) + len(s.response_ids) > self.max_positions:
                reasons.append(
                    Unscored("teacher_too_long", f"{len(prompt) + len(s.response_ids)} tokens > {self.max_positions}")
                )
            else:
                reasons.append(None)
        return reasons

    async def score(self, group: Group) -> list[RewardResult]:
        reasons = self.check(group)
        todo = [i for i, r in enumerate(reasons) if r is None]
        rows = [(sample_prompt_ids(group, group.samples[i]), group.samples[i].response_ids) for i in todo]
        results: list[RewardResult] = list(reasons)
        try:
            values = await asyncio.wait_for(asyncio.to_thread(self.score_sequences, rows), self.cfg.timeout_s)
        except TimeoutError:
            self._warn("teacher_timeout", group)
            return [Unscored("teacher_timeout", f"no logprobs within {self.cfg.timeout_s} s")] * len(group.samples)
        except Exception as e:  # a failing teacher leaves the group unscored, with the reason
            self._warn("teacher_error", group, e)
            return [Unscored("teacher_error", f"{type(e).__name__}: {e}"[:200])] * len(group.samples)
        for i, v in zip(todo, values):
            ok = np.isfinite(v).all()
            results[i] = TeacherLogprobs(v) if ok else Unscored("nonfinite_score", "the teacher gave NaN or inf")
        return results

    def _warn(self, reason: str, group: Group, error: BaseException | None = None) -> None:
        self.failures += 1
        if self.failures == 1:  # once: the counters say how often (asyncrl_reward_unscored_samples_total)
            log.warning("reward %s: %s on group %s: %s", self.name, reason, group.group_id, error or "")

    async def close(self) -> None:
        close = getattr(getattr(self, "backend", None), "close", None)
        if close is not None:
            close()
