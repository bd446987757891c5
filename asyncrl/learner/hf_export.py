"""The policy's weights out of its DeepSpeed engine: a full state dict, or a Hugging Face model dir.

Under ZeRO-3 every rank holds a shard of each parameter, so both are collective: each module's
partitions are all-gathered in turn, copied and released, so at most one module is whole at a
time; every rank must call them. The model dir written is the one the generators, the evaluator
and ``from_pretrained`` read: the config (dtype float32), fp32 ``model.safetensors``, and every
other file of the starting model dir (tokenizer, generation config) copied as is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# Files of a Hugging Face model dir that ``save_pretrained`` writes itself instead of copying.
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


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


def save_pretrained(module: torch.nn.Module, zero_stage: int, hf_config, model_dir: Path, out_dir: str | Path) -> Path:
    """Write ``module``'s weights as a Hugging Face model dir ``out_dir``, beside the config
    ``hf_config`` (saved with dtype float32) and the other files of ``model_dir``.

    Collective under ZeRO-3; rank 0 writes; every rank waits for it. Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    state = full_state_dict(module, zero_stage, rank0_only=True)
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for path in model_dir.iterdir():
            if (
                path.is_file()
                and path.name != "config.json"
                and path.name not in _WEIGHT_INDEX_FILES
                and not path.name.endswith(_WEIGHT_FILE_SUFFIXES)
            ):
                shutil.copy2(path, out / path.name)
        if getattr(hf_config, "tie_word_embeddings", False):
            # A tied output head is the embedding: HF stores it once and re-ties on load.
            state.pop("lm_head.weight", None)
        # safetensors refuses tensors that share memory; give each key its own.
        seen: set[int] = set()
        for key, tensor in list(state.items()):
            if id(tensor) in seen:
                state[key] = tensor.clone()
            seen.add(id(tensor))
        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
        )
        config = hf_config.__class__.from_dict(hf_config.to_dict())
        config.dtype = "float32"
        config.save_pretrained(out)
    torch.distributed.barrier()
    return out
