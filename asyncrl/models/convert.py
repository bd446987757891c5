"""A GGUF file -> a plain safetensors Hugging Face folder that vLLM and DeepSpeed load.

transformers reads GGUF (with the ``gguf`` package) by de-quantising every tensor into the dtype
asked for, but the model it returns carries a GGUF quantization config and refuses
``save_pretrained``. So the weights are copied into a model of the same class built from the
config with ``quantization_config`` removed, and that one is saved, with the tokenizer (and its
chat template) beside it. De-quantised Q4_1 weights are exact in float32; bfloat16 rounds them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def convert_gguf(gguf: Path, out: Path, dtype: str) -> dict:
    """Write ``gguf`` as ``config.json`` + ``model.safetensors`` + tokenizer files into ``out``
    (which must not exist) in ``dtype`` (``float32`` or ``bfloat16``); returns what it wrote:
    parameters, seconds, whether a chat template came with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    torch_dtype = getattr(torch, dtype)
    # De-quantise in float32 whatever the target: the bfloat16 copy is then one rounding of the
    # exact values, not a rounding of a rounding.
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(
            f"{gguf}: de-quantised weights do not fit {type(plain).__name__}: missing {missing}, unexpected {unexpected}"
        )
    plain.generation_config = loaded.generation_config
    plain.to(torch_dtype)
    out.mkdir(parents=True)
    plain.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    parameters = sum(p.numel() for p in plain.parameters())
    seconds = time.monotonic() - start
    log.info("converted %s to %s (%s, %d parameters) in %.1f s", gguf.name, out, dtype, parameters, seconds)
    return {"parameters": parameters, "seconds": round(seconds, 1), "chat_template": bool(tokenizer.chat_template)}
