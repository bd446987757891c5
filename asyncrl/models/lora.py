"""LoRA adapters (``peft``) on a Hugging Face causal LM: the config, the wrap, the adapter out.

``apply_lora(model, cfg)`` is the one call a trainer makes (the RL learner, the SFT command):
it wraps a loaded model in a ``peft.PeftModel`` whose base weights are frozen
(``requires_grad=False``) and whose low-rank adapters, on the ``target_modules`` linear layers,
are the only trainable parameters: W x + (alpha / r) B A x, A (r, in) random, B (out, r) zero, so
the wrapped model starts exactly at the base model. An optimizer built on
``trainable_parameters(model)`` then holds moments for the adapter alone.

Why it lives in ``asyncrl.models``: the learner (training), ``asyncrl.models.export`` (writing the
adapter and the merged model) and the root config (``model.lora``) all use it, and this layer is
below them all.

**The adapter on the wire** (the contract with the generators that serve it). With ``model.lora``
set, each published version (``PolicyTrainer.weight_buckets``, through any ``asyncrl.weights``
transport) carries ONLY the adapter's tensors:

- named as ``peft.get_peft_model_state_dict`` names them, e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``lora_A``: (r, in),
  ``lora_B``: (out, r); ``adapter_state_names`` gives the name of each parameter);
- in the training dtype of the model (bf16 under ``learner.trainer.dtype: bf16``, else fp32);
- and the publication's meta carries ``"adapter": adapter_meta(cfg)``, i.e.
  ``{"r": rank, "lora_alpha": alpha, "target_modules": [...], "base_version": 0}``: the base the
  adapter applies to is always the starting model (version 0), which never changes in a LoRA run.

A generator builds the peft adapter folder from these (``adapter_config.json`` from the meta,
``adapter_model.safetensors`` from the tensors, exactly what ``save_adapter`` writes) and serves
it on top of the base model it started from. Full-weight runs (``model.lora: null``) publish the
whole model as before and carry no ``adapter`` in their meta.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from asyncrl.configbase import Config

if TYPE_CHECKING:
    import torch

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Qwen2 and Llama (and SmolLM2, a Llama): every linear
layer of a block, as the QLoRA paper found best."""

ADAPTER_DIR = "adapter"
"""The adapter's folder (peft format) inside a LoRA run's ``RUN_DIR/final``, beside the merged model."""

ADAPTER_NAME = "default"
"""peft's name of the one adapter (it appears in parameter names, never on the wire)."""


class LoraConfig(Config):
    """LoRA adapters on the policy (``peft``): base weights frozen, only the adapters train."""

    rank: int = 16
    """r, the adapters' rank: each target layer W (out, in) gains B (out, r) A (r, in)."""
    alpha: int = 32
    """lora_alpha: the adapter's update is scaled by alpha / rank (so a change of rank keeps the step size at alpha fixed)."""
    dropout: float = Field(0.0)
    """Dropout on each adapter's input during training forwards (peft's lora_dropout); 0 keeps the learner's logprobs those of the served policy."""
    target_modules: list[str] = list(DEFAULT_TARGET_MODULES)
    """Names (last component) of the linear layers that get an adapter; default: Qwen2's and Llama's attention and MLP projections."""

    @field_validator("rank", "alpha")
    @classmethod
    def _check_positive(cls, v: int, info) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} ({v}) must be >= 1")
        return v

    @field_validator("dropout")
    @classmethod
    def _check_dropout(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError(f"dropout ({v}) must be in [0, 1)")
        return v

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, v: list[str]) -> list[str]:
        if not v or any(not name or "." in name for name in v):
            raise ValueError(
                f"target_modules ({v}) must be a non-empty list of layer names without dots (e.g. q_proj, down_proj)"
            )
        return v


def peft_config(cfg: LoraConfig):
    """The ``peft.LoraConfig`` of ``cfg`` (bias untrained, causal LM)."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model, cfg: LoraConfig):
    """``model`` (a loaded HF causal LM) wrapped in a ``peft.PeftModel``: base frozen, adapters
    on ``cfg.target_modules`` trainable. Raises ValueError naming the targets when a name matches
    no layer of the model."""
    import peft

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in cfg.target_modules if t not in names]
    if missing:
        raise ValueError(
            f"model.lora.target_modules {missing} match no layer of the model "
            f"({type(model).__name__}); its linear layers: {sorted(_linear_names(model))}"
        )
    return peft.get_peft_model(model, peft_config(cfg))


def _linear_names(model) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def trainable_parameters(model) -> list[torch.Tensor]:
    """The parameters an optimizer should hold: with LoRA the adapters only."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_name(param_name: str) -> str:
    """A PeftModel parameter's name as ``get_peft_model_state_dict`` writes it (the adapter's
    name dropped).

    >>> adapter_state_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    """
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_parameters(model) -> list[tuple[str, torch.Tensor]]:
    """``(wire name, parameter)`` of each adapter tensor of a PeftModel, in module order (the
    trainable parameters: the base is frozen)."""
    return [(adapter_state_name(name), p) for name, p in model.named_parameters() if p.requires_grad]


def adapter_meta(cfg: LoraConfig, base_version: int = 0) -> dict:
    """What a generator needs beside the tensors to load a published adapter (the ``adapter``
    entry of the publication's meta).

    >>> adapter_meta(LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    {'r': 8, 'lora_alpha': 16, 'target_modules': ['q_proj', 'v_proj'], 'base_version': 0}
    """
    return {
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "target_modules": list(cfg.target_modules),
        "base_version": base_version,
    }


def save_adapter(
    tensors: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str | Path, out_dir: str | Path
) -> Path:
    """Write an adapter in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``,
    what ``PeftModel.from_pretrained`` loads) from its tensors, named as on the wire, kept in
    their dtype. ``base_model``: the model it applies to (``base_model_name_or_path``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(cfg)
    config.base_model_name_or_path = str(base_model)
    config.save_pretrained(str(out))  # adapter_config.json, as PeftModel.save_pretrained writes it
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def merged_model(base_dir: str | Path, adapter_dir: str | Path):
    """The base model with the adapter folded into its weights (W + alpha/r B A): a plain HF
    model, fp32, that needs no peft to load."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def write_lora_model(
    tensors: dict[str, torch.Tensor], cfg: LoraConfig, base_dir: str | Path, out_dir: str | Path
) -> Path:
    """The adapter ``tensors`` (wire names) on the base model ``base_dir``, written as ``out_dir``:
    the merged model (a Hugging Face model dir, fp32, with the base's tokenizer and other files)
    and, in ``out_dir/adapter``, the adapter in peft's format. Returns ``out_dir``."""
    base, out = Path(base_dir), Path(out_dir)
    save_adapter(tensors, cfg, base, out / ADAPTER_DIR)
    for path in base.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_FILE_SUFFIXES) and not path.name.endswith(".index.json"):
            shutil.copy2(path, out / path.name)
    merged = merged_model(base, out / ADAPTER_DIR)
    merged.config.dtype = "float32"
    merged.save_pretrained(str(out), safe_serialization=True)
    return out


_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
