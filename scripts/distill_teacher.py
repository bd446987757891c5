"""Build the teacher of ``configs/distill_addition.yaml`` once, from the repository alone, and score it.

The teacher is the tiny Qwen2 at the shape and SFT length of ``configs/distill_teacher.yaml``
(``asyncrl build-tiny-model --warm-start --config configs/distill_teacher.yaml``), written to
``runs/teachers/distill_addition`` (the path the recipe's ``teacher`` reward names). It is
cached: built again only when the teacher recipe changes (its sha256 is kept beside the model
in ``recipe.sha256``). Its held-out exact match (greedy, Hugging Face, the recipe's held-out
prompts) goes into ``teacher.json`` beside it and is printed.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/distill_teacher.py [--recipe configs/distill_teacher.yaml] [--out DIR]

Run it under ``flock /tmp/asyncrl-heavy.lock`` on a shared machine (~3 min of SFT on one core).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "distill_teacher.yaml"
OUT = REPO / "runs" / "teachers" / "distill_addition"


def ensure_teacher(recipe: Path = RECIPE, out: Path = OUT) -> dict:
    """The teacher built (or found cached) at ``out/warm``, and its held-out figures."""
    digest = hashlib.sha256(recipe.read_bytes()).hexdigest()
    stamp, figures = out / "recipe.sha256", out / "teacher.json"
    built = stamp.exists() and stamp.read_text().strip() == digest and (out / "warm" / "config.json").exists()
    if built and figures.exists():
        return {**json.loads(figures.read_text()), "cached": True}
    build_s = None
    if not built:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        asyncrl = Path(sys.executable).with_name("asyncrl")
        started = time.perf_counter()
        command = [str(asyncrl), "build-tiny-model", str(out), "--warm-start", "--config", str(recipe)]
        printed = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO).stdout
        build_s = time.perf_counter() - started
        (out / "build.json").write_text(printed.strip().splitlines()[-1] + "\n")  # the SFT's figures
        stamp.write_text(digest + "\n")
    sft = json.loads((out / "build.json").read_text()) if (out / "build.json").exists() else {}
    result = {
        "teacher": str(out / "warm"),
        "recipe": str(recipe.relative_to(REPO)) if recipe.is_relative_to(REPO) else str(recipe),
        "sft_steps": sft.get("steps"),
        "sft_final_loss": sft.get("final_loss"),
        "build_s": build_s,
        "parameters": parameters(out / "warm"),
        "heldout": heldout(recipe, out / "warm"),
    }
    figures.write_text(json.dumps(result, indent=2) + "\n")
    return {**result, "cached": False}


def parameters(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def heldout(recipe: Path, model_dir: Path) -> float:
    """Greedy held-out exact match of ``model_dir`` on ``recipe``'s held-out prompts (Hugging Face, float32)."""
    from asyncrl.config import load_config
    from asyncrl.models.hf_eval import evaluate_exact_match
    from asyncrl.tasks.prompts import load_run_prompts

    cfg = load_config(str(recipe), [])
    prompts = load_run_prompts(cfg, "test", model_dir)[: cfg.eval.num_prompts]
    return float(evaluate_exact_match(model_dir, None, prompts, max_new_tokens=cfg.eval.max_new_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(RECIPE), help="the teacher's recipe (model.tiny, task, sft)")
    parser.add_argument("--out", default=str(OUT), help="where the teacher goes (its model in OUT/warm)")
    args = parser.parse_args()
    result = ensure_teacher(Path(args.recipe).resolve(), Path(args.out).resolve())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
