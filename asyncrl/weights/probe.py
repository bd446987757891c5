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
