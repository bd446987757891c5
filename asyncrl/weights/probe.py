"""The probe: after a weight update, the generator's logprobs of a fixed text must match the learner's.

The learner scores a fixed prompt + continuation with the weights it just published
(``learner_probe``) and sends ``{"prompt", "continuation_ids", "logprobs"}`` along with the
version. The generator, once it has applied the version, scores the same tokens with its engine
(``VLLMEngine.score``: temperature-1 prompt logprobs) and ``check_probe`` raises
``WeightSyncError`` when any position differs by more than ``atol``: weights that did not load,
loaded into the wrong tensors, or stale KV from the prefix cache all show up here.
"""

from __future__ import annotations

import numpy as np

from asyncrl.weights.update import WeightSyncError

PROBE_TOLERANCES = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
"""Probe tolerance by the coarser dtype of the two sides. A float32 engine and learner agree to
~1e-5 (1e-3 leaves room for kernels that sum in another order). A 16-bit side rounds every
weight and activation (relative error 2^-11 for float16, 2^-8 for bfloat16), which a forward
pass of many layers turns into logprob differences of ~1e-3 (float16) and ~1e-2 (bfloat16):
the tolerances keep a factor of about five above that, and far below what a weight that did
not load gives (differences of order 1 and more)."""
_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "auto": "bfloat16",
    # Decided on the device that computes, not here: the looser tolerance holds either way.
    "bf16_if_native": "bfloat16",
    "bfloat16_if_native": "bfloat16",
}

PROBE_PROMPT = "12+34="
PROBE_CONTINUATION = "46"


def learner_probe(model, tokenizer, prompt: str = PROBE_PROMPT, continuation: str = PROBE_CONTINUATION) -> dict:
    """Temperature-1 logprobs the (full, unpartitioned) ``model`` gives ``continuation`` after ``prompt``."""
    import torch

    prompt_ids = list(tokenizer.encode(prompt))
    cont_ids = list(tokenizer.encode(continuation, add_special_tokens=False))
    ids = torch.tensor([prompt_ids + cont_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0]  # (P+C, V)
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)  # (C, V)
    picked = logprobs.gather(1, torch.tensor(cont_ids, device=logits.device)[:, None])[:, 0]
    return {
        "prompt": prompt,
        "continuation_ids": cont_ids,
        "logprobs": picked.cpu().numpy().astype(np.float32).tolist(),
    }


def check_probe(engine, probe: dict, atol: float, version: int) -> float:
    """Score ``probe`` on ``engine``; return the largest |difference|, raise past ``atol``."""
    got = np.asarray(engine.score(probe["prompt"], list(probe["continuation_ids"])), dtype=np.float64)
    want = np.asarray(probe["logprobs"], dtype=np.float64)
    diff = float(np.max(np.abs(got - want))) if len(want) else 0.0
    if got.shape != want.shape or not diff <= atol:
        raise WeightSyncError(
            f"probe after applying version {version}: generator logprobs {np.round(got, 5).tolist()} differ from the "
            f"learner's {np.round(want, 5).tolist()} by {diff:.3g} > atol {atol}: the served weights are not the published ones"
        )
    return diff


def probe_tolerance(engine_dtype: str, trainer_dtype: str) -> float:
    """The probe's ``atol`` for an engine in ``engine_dtype`` (``float32``, ``bfloat16``,
    ``float16``, ``auto``: the model's own, taken as bfloat16, the usual checkpoint dtype;
    ``bfloat16_if_native``: taken as bfloat16) and a learner in ``trainer_dtype`` (``fp32``,
    ``bf16``, ``bf16_if_native``: taken as bf16): the looser of the two sides'.

    >>> probe_tolerance("float32", "fp32"), probe_tolerance("bfloat16", "bf16"), probe_tolerance("float32", "bf16")
    (0.001, 0.05, 0.05)
    """
    sides = []
    for dtype in (engine_dtype, trainer_dtype):
        name = _ALIASES.get(dtype, dtype)
        if name not in PROBE_TOLERANCES:
            raise ValueError(f"dtype ({dtype!r}) must be one of {sorted(PROBE_TOLERANCES) + sorted(_ALIASES)}")
        sides.append(PROBE_TOLERANCES[name])
    return max(sides)
