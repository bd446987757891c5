"""Models built partitioned under ZeRO-3: no rank ever holds a whole model.

Without ZeRO-3 every rank holds the whole model anyway, and ``build_causal_lm`` is plain
``from_pretrained`` in fp32. Under ``zero_stage: 3`` a rank should hold its 1/N share of each
parameter and nothing more, from the start, so it is built in two steps:

1. **construction inside ``deepspeed.zero.Init``** (``zero3_init``), with the learner's own
   DeepSpeed config, so that the partitions have the engine's dtype (bf16 under bf16) and
   process group: each module's parameters are partitioned as soon as that module is built, so
   at most one module is whole at a time. Random initialisation is skipped
   (transformers' ``no_init_weights``): every weight is overwritten by step 2.
2. **loading module by module** (``load_partitioned``): for each module in turn its own
   parameters are gathered (``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``),
   rank 0 copies the checkpoint's tensors into them, read one at a time from the safetensors
   file(s) (``CheckpointReader``: the headers, then each tensor's bytes, nothing else), and on
   leaving the block rank 0's values are broadcast and every rank keeps its partition; the
   freed blocks are handed back to the system (``heap``). Extra memory: the largest module
   whole (the embedding or the LM head), and on rank 0 one checkpoint tensor beside it.

So a rank holds its share plus about one module, whatever the model's size
(``tests/learner/test_zero_init.py`` measures it).

Where this differs from transformers (which OpenRLHF and verl use for the same job:
``from_pretrained`` under a live ``HfDeepSpeedConfig``), and why:

- transformers 5.19 reads every checkpoint file into one state dict on every rank before it
  loads any of it, so every rank maps (and, for a pickled ``.bin`` checkpoint, holds)
  the whole model; here only rank 0 reads, one tensor at a time;
- it switches ZeRO-3 on through a process-wide setting (a weak reference to the
  ``HfDeepSpeedConfig``) that changes every later ``from_pretrained`` in the process while the
  object lives; here the context is explicit and ends with the construction;
- it initialises the random weights module by module under a gather before overwriting them;
  here they are never initialised.

Tied weights (the output head that is the embedding, SmolLM2's and Qwen2.5-0.5B's) stay one
parameter: the model is tied after construction (``tie_weights``), as ``from_pretrained`` ties
it, and the tied parameter is loaded once, from the name the checkpoint stores it under.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.heap import release_freed_memory

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def zero3_init(cfg: TrainerConfig):
    """``deepspeed.zero.Init`` with the learner's DeepSpeed config (``deepspeed_setup.deepspeed_config``):
    the modules built inside it are partitioned over the learner's ranks, in the engine's dtype."""
    # Imported before zero.Init patches module construction: their first import must not happen inside it.
    import deepspeed
    import torch._dynamo  # noqa: F401

    from asyncrl.learner.deepspeed_setup import deepspeed_config

    return deepspeed.zero.Init(config_dict_or_path=deepspeed_config(cfg))


def build_causal_lm(model_dir: str | Path, cfg: TrainerConfig) -> torch.nn.Module:
    """The causal LM of ``model_dir`` with its weights: in fp32, whole, below ZeRO-3 (DeepSpeed
    casts it); under ``zero_stage: 3`` built partitioned and loaded module by module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = cfg.attn_implementation  # learner.trainer.attn_implementation
    if cfg.zero_stage < 3:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    config = AutoConfig.from_pretrained(model_dir)
    model = build_partitioned(
        lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn), cfg
    )
    missing = load_partitioned(model, model_dir)
    if missing:
        raise ValueError(
            f"{model_dir}: the checkpoint lacks {missing[:5]} ({len(missing)} tensors) of {type(model).__name__}"
        )
    return model


def build_partitioned(build: Callable[[], torch.nn.Module], cfg: TrainerConfig) -> torch.nn.Module:
    """``build()`` run inside ``zero3_init(cfg)`` without random initialisation, then tied: a model
    whose parameters are partitioned and hold nothing meaningful until ``load_partitioned``."""
    from transformers import AutoModelForCausalLM  # noqa: F401  (imported before zero.Init: see zero3_init)
    from transformers.initialization import no_init_weights

    with zero3_init(cfg), no_init_weights():
        model = build()
    tie = getattr(model, "tie_weights", None)
    if tie is not None:  # init_weights, which ties, was skipped with the initialisation
        tie()
    return model


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""The safetensors dtype names a checkpoint of weights uses, and their torch dtypes."""


class CheckpointReader:
    """The tensors of a Hugging Face model dir's safetensors file(s), read one at a time.

    One ``model.safetensors``, or several listed by ``model.safetensors.index.json``. Only the
    headers are read on construction (names, dtypes, shapes, offsets); ``get`` reads one tensor's
    bytes into a new tensor with ``readinto``, nothing else. Not through a memory map (as
    ``safetensors.safe_open`` reads): the file's pages that a map touches stay in the process's
    resident set while the map lives, which would put the whole checkpoint in rank 0's resident
    memory by the end of a load.
    """

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        index = model_dir / SAFETENSORS_INDEX
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (model_dir / SAFETENSORS_FILE).exists():
            files = [SAFETENSORS_FILE]
        else:
            raise FileNotFoundError(
                f"{model_dir} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}: "
                "a model loaded partitioned (zero_stage 3) must be saved as safetensors"
            )
        self._where: dict[str, tuple[Path, int, torch.dtype, list[int], int]] = {}
        for name in files:
            path = model_dir / name
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info["dtype"] not in SAFETENSORS_DTYPES:
                    raise ValueError(
                        f"{path}: {key} has dtype {info['dtype']}, not one of {sorted(SAFETENSORS_DTYPES)}"
                    )
                begin, end = info["data_offsets"]
                self._where[key] = (
                    path,
                    8 + size + begin,
                    SAFETENSORS_DTYPES[info["dtype"]],
                    info["shape"],
                    end - begin,
                )

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``, read now (the only copy of it this reader makes)."""
        path, offset, dtype, shape, nbytes = self._where[key]
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
        got = 0
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            while got < nbytes:  # one read returns at most ~2 GiB on Linux
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{path}: read {got} of {nbytes} bytes of {key}: the file ends early")
                got += n
        return out


def load_partitioned(module: torch.nn.Module, model_dir: str | Path, prefix: str = "") -> list[str]:
    """Copy the checkpoint's tensors of ``model_dir`` into ``module``, one module's own parameters
    at a time; the checkpoint names ``module``'s parameter ``name`` as ``prefix + name``.

    Under ZeRO-3 (partitioned parameters) collective: every rank calls it; rank 0 reads the
    checkpoint and its values reach every rank's partitions. Persistent buffers, never
    partitioned, are read by every rank. A parameter already loaded (a tied one, met again under
    its second name) is skipped. Returns the names of the parameters the checkpoint lacks (left
    as they are), for the caller to judge.
    """
    import deepspeed

    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    # Every rank reads the files' headers (which names they hold), so all enter the same gathers;
    # of a partitioned parameter only rank 0 reads the data.
    reader = CheckpointReader(model_dir)
    writes = not partitioned or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    done: set[int] = set()
    for mod_name, mod in module.named_modules():
        base = f"{mod_name}." if mod_name else ""
        own = [(prefix + base + name, p) for name, p in mod.named_parameters(recurse=False) if id(p) not in done]
        own = [(key, p) for key, p in own if key in reader]
        if own:
            params = [p for _, p in own]
            gather = (
                deepspeed.zero.GatheredParameters(params, modifier_rank=0) if partitioned else contextlib.nullcontext()
            )
            with gather, torch.no_grad():
                if writes:
                    for key, p in own:
                        p.copy_(reader.get(key))
            done.update(id(p) for p in params)
            release_freed_memory()
        for name, buf in mod.named_buffers(recurse=False):
            key = prefix + base + name
            if buf is not None and name not in mod._non_persistent_buffers_set and key in reader:
                with torch.no_grad():
                    buf.copy_(reader.get(key))
    return [name for name, p in module.named_parameters() if id(p) not in done]


def zero_partitioned(params: list[torch.nn.Parameter]) -> None:
    """Set ``params`` to 0 on every rank, partitioned or not (``torch.nn.init.zeros_`` on a
    ZeRO-3 parameter outside a gather would change an empty placeholder only)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for p in params:
            p.zero_()
