"""``asyncrl export RUN_DIR [--step N] OUT_DIR``: a run's policy as a Hugging Face model directory.

Without ``--step`` it is the final model the learner saved (``RUN_DIR/final``); with it, the
policy of version N from the run's checkpoint of that version (``RUN_DIR/checkpoints/vNNNNNNNN``:
DeepSpeed's checkpoint at any ZeRO stage, consolidated to fp32 from the optimizer's master
weights) or, failing that, the weights published at version N (``RUN_DIR/weights/vNNNNNN``: only
the ``weights.transport: file`` broadcast leaves versions in the run directory), joined with the
config and tokenizer of the model the run started from. Either way the result is
``config.json`` + ``model.safetensors`` + tokenizer files, which ``from_pretrained`` and vLLM
load. It is written to a temporary folder and renamed, so a half-written export never exists.

A LoRA run (``model.lora`` in its config) exports its adapter in peft's format
(``adapter_config.json`` + ``adapter_model.safetensors``, which ``PeftModel.from_pretrained``
loads on the starting model), or with ``--merge`` the starting model with the adapter folded
in, a plain Hugging Face model dir as above. Without ``--step`` both come from
``RUN_DIR/final`` (the merged model, its adapter in ``final/adapter``); with it, the adapter is
read from the checkpoint (which holds the adapter only) or from the published version.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from asyncrl.configbase import UserError, UserFileError, load_yaml

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class ExportExistsError(UserError, FileExistsError):
    """The folder to export into exists already (an export never replaces one)."""


def published_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (run_dir / "weights").glob("v[0-9]*") if p.is_dir())


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (run_dir / "checkpoints").glob("v[0-9]*") if (p / "learner").is_dir())


def save_checkpoint_weights(learner_dir: Path, model_dir: Path, out_file: Path) -> None:
    """The policy in a learner checkpoint as one fp32 safetensors file with the model's own names."""
    import json

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    policy = learner_dir / "policy"
    if not list(policy.glob("*optim_states.pt")):
        # ZeRO-0 keeps no partitioned fp32 copy (zero_to_fp32 has nothing to read): the engine's
        # module states are the weights.
        state = torch.load(policy / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    else:
        state = get_fp32_state_dict_from_zero_checkpoint(str(learner_dir), tag="policy")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # a tied head is the embedding; loading ties it again
    tensors, seen = {}, set()
    for key, tensor in state.items():
        t = tensor.detach().to(torch.float32).contiguous()
        tensors[key] = t.clone() if t.data_ptr() in seen else t  # safetensors refuses shared memory
        seen.add(t.data_ptr())
    save_file(tensors, str(out_file), metadata={"format": "pt"})


def run_lora(run_dir: Path):
    """The run's ``model.lora`` (an ``asyncrl.models.lora.LoraConfig``), None for a full-weight run."""
    from asyncrl.models.lora import LoraConfig

    lora = (load_yaml(run_dir / "config.yaml").get("model") or {}).get("lora")
    return None if lora is None else LoraConfig(**lora)


def checkpoint_adapter(learner_dir: Path) -> dict:
    """The adapter of a LoRA learner checkpoint, wire names (``asyncrl.models.lora``), fp32: from
    the optimizer's master weights under ZeRO 1-3, from the module under ZeRO-0 (its checkpoint
    holds the adapter alone: the frozen base is never saved)."""
    import torch

    from asyncrl.models.lora import adapter_state_name

    policy = learner_dir / "policy"
    if (policy / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists():  # ZeRO 1-3
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(
            str(learner_dir), tag="policy", exclude_frozen_parameters=True
        )
    else:
        module = torch.load(policy / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    return {adapter_state_name(k): v.detach().to(torch.float32) for k, v in module.items() if "lora_" in k}


def starting_model_dir(run_dir: Path) -> Path:
    """The model the run trained from: the warm start, the built tiny model, or ``model.path``."""
    for candidate in (run_dir / "model" / "warm", run_dir / "model" / "base"):
        if (candidate / "config.json").exists():
            return candidate
    # The run wrote its config.yaml once it had validated it; only model.path is needed here, so
    # the file is read as YAML rather than as a RunConfig, which this layer does not import.
    path = (load_yaml(run_dir / "config.yaml").get("model") or {}).get("path")
    if path is None:
        raise UserFileError(f"{run_dir}: no starting model (model/warm, model/base or model.path)")
    from asyncrl.models.fetch import resolve_model_path

    return resolve_model_path(path)  # a known model's name is its fetched folder


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None, merge: bool = False) -> Path:
    """Write the run's policy (of version ``step``; None: the final one) into ``out_dir``; for a
    LoRA run its adapter, or with ``merge`` the merged model. Returns ``out_dir``."""
    run_dir, out = Path(run_dir), Path(out_dir)
    if out.exists():
        raise ExportExistsError(f"{out} exists: export writes a new folder; give another OUT_DIR or remove it")
    lora = run_lora(run_dir)
    if merge and lora is None:
        raise UserError(f"--merge folds a LoRA adapter into its base; {run_dir} is a full-weight run (model.lora null)")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if lora is not None:
        export_lora(run_dir, tmp, lora, step, merge)
    elif step is None:
        final = run_dir / "final"
        if not (final / "model.safetensors").exists():
            raise UserFileError(
                f"{final} holds no model: the run did not finish; pass --step N {published_steps(run_dir)}"
            )
        shutil.copytree(final, tmp)
    else:
        checkpoint = run_dir / "checkpoints" / f"v{step:08d}" / "learner"
        weights = run_dir / "weights" / f"v{step:06d}"
        if not checkpoint.is_dir() and not weights.is_dir():
            raise UserFileError(
                f"step ({step}) has no checkpoint and was not published; checkpoints: {checkpoint_steps(run_dir)}, "
                f"published: {published_steps(run_dir)}"
            )
        tmp.mkdir(parents=True)
        start = starting_model_dir(run_dir)
        for path in start.iterdir():
            if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.endswith(".index.json"):
                shutil.copy2(path, tmp / path.name)
        if checkpoint.is_dir():
            save_checkpoint_weights(checkpoint, start, tmp / "model.safetensors")
        else:
            for path in weights.glob("*.safetensors"):
                shutil.copy2(path, tmp / path.name)
    for path in tmp.rglob("*"):  # durable before it becomes visible
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def export_lora(run_dir: Path, tmp: Path, lora, step: int | None, merge: bool) -> None:
    """A LoRA run's export into ``tmp``: the adapter (peft format), or with ``merge`` the merged
    model; see the module docstring."""
    from asyncrl.models.lora import ADAPTER_DIR, save_adapter, write_lora_model

    if step is None:
        final = run_dir / "final"
        if not (final / ADAPTER_DIR / "adapter_model.safetensors").exists():
            raise UserFileError(
                f"{final} holds no adapter: the run did not finish; pass --step N {checkpoint_steps(run_dir)}"
            )
        if merge:
            shutil.copytree(final, tmp, ignore=shutil.ignore_patterns(ADAPTER_DIR))
        else:
            shutil.copytree(final / ADAPTER_DIR, tmp)
        return
    checkpoint = run_dir / "checkpoints" / f"v{step:08d}" / "learner"
    weights = run_dir / "weights" / f"v{step:06d}"
    if checkpoint.is_dir():
        tensors = checkpoint_adapter(checkpoint)
    elif weights.is_dir():
        from safetensors.torch import load_file

        tensors = {k: v for path in sorted(weights.glob("*.safetensors")) for k, v in load_file(path).items()}
    else:
        raise UserFileError(
            f"step ({step}) has no checkpoint and was not published; checkpoints: {checkpoint_steps(run_dir)}, "
            f"published: {published_steps(run_dir)}"
        )
    start = starting_model_dir(run_dir)
    if merge:
        tmp.mkdir(parents=True)
        write_lora_model(tensors, lora, start, tmp)
        shutil.rmtree(tmp / ADAPTER_DIR)
    else:
        save_adapter(tensors, lora, start, tmp)
