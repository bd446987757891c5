"""``asyncrl export RUN_DIR [--step N] OUT_DIR``: a run's policy as a Hugging Face model directory.

Without ``--step`` it is the final model the learner saved (``RUN_DIR/final``); with it, the
weights published at policy version N (``RUN_DIR/weights/vNNNNNN``, the newest few are kept;
only the ``weights.transport: file`` broadcast leaves versions in the run directory) joined with
the config and tokenizer of the model the run started from. Either way the result is
``config.json`` + ``model.safetensors`` + tokenizer files, which ``from_pretrained`` and vLLM
load. It is written to a temporary folder and renamed, so a half-written export never exists.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def published_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (run_dir / "weights").glob("v[0-9]*") if p.is_dir())


def starting_model_dir(run_dir: Path) -> Path:
    """The model the run trained from: the warm start, the built tiny model, or ``model.path``."""
    from asyncrl.config import load_run_config

    for candidate in (run_dir / "model" / "warm", run_dir / "model" / "base"):
        if (candidate / "config.json").exists():
            return candidate
    path = load_run_config(run_dir / "config.yaml").model.path
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no starting model (model/warm, model/base or model.path)")
    return Path(path)


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    run_dir, out = Path(run_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; export writes a new folder")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if step is None:
        final = run_dir / "final"
        if not (final / "model.safetensors").exists():
            raise FileNotFoundError(
                f"{final} holds no model: the run did not finish; pass --step N {published_steps(run_dir)}"
            )
        shutil.copytree(final, tmp)
    else:
        weights = run_dir / "weights" / f"v{step:06d}"
        if not weights.is_dir():
            raise FileNotFoundError(
                f"step ({step}) was not published or no longer kept; kept: {published_steps(run_dir)}"
            )
        tmp.mkdir(parents=True)
        for path in starting_model_dir(run_dir).iterdir():
            if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.endswith(".index.json"):
                shutil.copy2(path, tmp / path.name)
        for path in weights.glob("*.safetensors"):
            shutil.copy2(path, tmp / path.name)
    for path in tmp.iterdir():  # durable before it becomes visible
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
