"""The policy's weights out of its DeepSpeed engine: a full state dict, or a Hugging Face model dir.

Under ZeRO-3 every rank holds a shard of each parameter, so both are collective: each module's
partitions are all-gathered in turn, copied and released, so at most one module is whole at a
time; every rank must call them. The model dir written is the one the generators, the evaluator
and ``from_pretrained`` read: the config (dtype float32), fp32 ``model.safetensors``, and every
other file of the starting model dir (tokenizer, generation config) copied as is.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import torch

# Files of a Hugging Face model dir that ``save_pretrained`` writes itself instead of copying.
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

EXPORT_BUCKET_BYTES = 256 << 20
"""Bytes of weights gathered and written at a time by ``save_pretrained``."""


def full_state_dict(module: torch.nn.Module, zero_stage: int, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full weights of the engine's ``module``, HF names (``model.layers.0.self_attn.q_proj.weight``...),
    fp32 on CPU.

    Collective under ZeRO-3: call it on every rank. With ``rank0_only`` other ranks get ``{}``
    (saves a host copy of the model per rank). Under bf16 these are the bf16 module weights the
    generators will run, widened to fp32.
    """
    want = not rank0_only or torch.distributed.get_rank() == 0
    if zero_stage < 3:
        if not want:
            return {}
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in module.state_dict().items()}

    import deepspeed

    state: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}  # ds_id -> copy, so tied weights stay one tensor

    def visit(mod: torch.nn.Module, prefix: str) -> None:
        params = list(mod.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if want:
                for name, param in mod.named_parameters(recurse=False):
                    key = getattr(param, "ds_id", id(param))
                    if key not in copies:
                        # copy=True: on CPU .to("cpu") would alias the gathered buffer,
                        # which is freed (and reused) when the context exits.
                        copies[key] = param.detach().to("cpu", torch.float32, copy=True)
                    state[prefix + name] = copies[key]
                for name, buf in mod.named_buffers(recurse=False):
                    if buf is not None and name not in mod._non_persistent_buffers_set:
                        state[prefix + name] = buf.detach().to("cpu", torch.float32, copy=True)
        for name, child in mod.named_children():
            visit(child, prefix + name + ".")

    visit(module, "")
    return state


def save_pretrained(
    module: torch.nn.Module,
    zero_stage: int,
    hf_config,
    model_dir: Path,
    out_dir: str | Path,
    bucket_bytes: int = EXPORT_BUCKET_BYTES,
) -> Path:
    """Write ``module``'s weights as a Hugging Face model dir ``out_dir``, beside the config
    ``hf_config`` (saved with dtype float32) and the other files of ``model_dir``.

    The weights are streamed into ``model.safetensors`` one bucket of ``bucket_bytes`` at a time
    (``asyncrl.weights.buckets.iter_buckets``: gathered under ZeRO-3 while rank 0 writes them):
    the header first, from the parameters' full shapes, then each tensor's fp32 bytes in order,
    so rank 0 holds one bucket, not the model (a 1.31 B model's fp32 state dict is 5.2 GB).

    Collective under ZeRO-3; rank 0 writes; every rank waits for it. Returns ``out_dir``.
    """
    from asyncrl.weights.buckets import iter_buckets, plan_buckets

    out = Path(out_dir)
    writer = torch.distributed.get_rank() == 0
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))

    def kept(name: str) -> bool:  # a tied output head is the embedding: HF stores it once and re-ties on load
        return not (tied and name == "lm_head.weight")

    f = None
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        for path in model_dir.iterdir():
            if (
                path.is_file()
                and path.name != "config.json"
                and path.name not in _WEIGHT_INDEX_FILES
                and not path.name.endswith(_WEIGHT_FILE_SUFFIXES)
            ):
                shutil.copy2(path, out / path.name)
        shapes = [
            (name, tuple(getattr(t, "ds_shape", t.shape)))
            for plan in plan_buckets(module, bucket_bytes)
            for name, t in plan
            if kept(name)
        ]
        f = open(out / "model.safetensors", "wb")
        f.write(safetensors_header(shapes, {"format": "pt"}))
    try:
        for bucket in iter_buckets(module, bucket_bytes):  # collective under ZeRO-3: every rank iterates
            if f is not None:
                for name, t in bucket:
                    if kept(name):
                        f.write(memoryview(t.detach().to("cpu", torch.float32).contiguous().numpy()))
    finally:
        if f is not None:
            f.close()
    if writer:
        config = hf_config.__class__.from_dict(hf_config.to_dict())
        config.dtype = "float32"
        config.save_pretrained(out)
    torch.distributed.barrier()
    return out


def safetensors_header(shapes: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The safetensors header of fp32 tensors ``shapes`` stored back to back in that order: the
    header's length (8 bytes, little-endian), then its JSON, padded with spaces to 8 bytes as the
    safetensors library pads it.

    >>> h = safetensors_header([("a", (2, 3)), ("b", (4,))], {"format": "pt"})
    >>> import json; json.loads(h[8:])["b"]
    {'dtype': 'F32', 'shape': [4], 'data_offsets': [24, 40]}
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape in shapes:
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
