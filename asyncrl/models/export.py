"""``asyncrl export RUN_DIR [--step N] OUT_DIR``: a run's policy as a Hugging Face model directory.

Without ``--step`` it is the final model the learner saved (``RUN_DIR/final``); with it, the
policy of version N from the run's checkpoint of that version (``RUN_DIR/checkpoints/vNNNNNNNN``:
DeepSpeed's checkpoint at any ZeRO stage, consolidated to fp32 from the optimizer's master
weights) or, failing that, the weights published at version N (``RUN_DIR/weights/vNNNNNN``: only
the ``weights.transport: file`` broadcast leaves versions in the run directory), joined with the
config and tokenizer of the model the run started from. Either way the result is
``config.json`` + ``model.safetensors`` + tokenizer files, which ``from_pretrained`` and vLLM
load. It is written to a temporary folder and renamed, so a half-written export never exists.
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


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    run_dir, out = Path(run_dir), Path(out_dir)
    if out.exists():
        raise ExportExistsError(f"{out} exists: export writes a new folder; give another OUT_DIR or remove it")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if step is None:
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
    for path in tmp.iterdir():  # durable before it becomes visible
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
