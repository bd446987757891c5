"""What an offline run prepares before training: its run directory and the model it starts from.

The run directory is laid out as an RL run's, so the tools that read one read it too:
``config.yaml`` (the resolved ``OfflineConfig``), ``model/base`` (the tiny model, when built),
``checkpoints/vNNNNNNNN`` (``asyncrl export --step N``), ``final/`` (``asyncrl export``),
``tensorboard/``, and the offline run's own ``offline_steps.jsonl``, ``evals.jsonl``,
``summary.json`` and, for DPO, ``reference_logprobs.json``. Generated data (``data.train:
addition``) is written to ``data/train.jsonl`` and ``data/test.jsonl`` for inspection.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from asyncrl.configbase import UserFileError, UserValueError, load_yaml
from asyncrl.learner.offline.config import OfflineConfig, dump_offline_config

log = logging.getLogger("asyncrl")


def prepare_run_dir(cfg: OfflineConfig, resume: bool) -> Path:
    """A fresh ``run.root/run.name`` holding the resolved config, or with ``resume`` the existing
    one (its config rewritten with the overrides given)."""
    run_dir = (Path(cfg.run.root) / cfg.run.name).resolve()
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise UserFileError(f"cannot resume {run_dir}: it holds no config.yaml (give a run directory)")
    elif run_dir.exists():
        if not cfg.run.overwrite:
            raise UserValueError(f"run directory {run_dir} exists and run.overwrite is false")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_offline_config(cfg))
    (run_dir / "summary.json").unlink(missing_ok=True)
    return run_dir


def starting_model(cfg: OfflineConfig, run_dir: Path, build: bool) -> Path:
    """The model the run trains from: ``model.path`` (a folder, or a known model fetched into the
    cache), or the tiny model in ``run_dir/model/base``, built there when ``build`` (once, by
    the process that prepares the run) and seeded by ``run.seed``."""
    if cfg.model.path is not None:
        from asyncrl.models.fetch import resolve_model_path

        return resolve_model_path(cfg.model.path)
    base = run_dir / "model" / "base"
    if build and not (base / "config.json").is_file():
        from asyncrl.models.tiny import build_tiny_model

        build_tiny_model(cfg.model.tiny.model_copy(update={"seed": cfg.run.seed}), base)
        log.info("built the tiny model in %s", base)
    if not (base / "config.json").is_file():
        raise UserFileError(f"{base} holds no model: the run was not prepared (asyncrl sft/dpo prepares it)")
    return base


def resume_offline_config(run_dir: str | Path, overrides: list[str]):
    """The config a run was started with, with ``overrides``, placed where the run now lives."""
    from asyncrl.learner.offline.config import OfflineConfig

    path = Path(run_dir).resolve()
    if not (path / "config.yaml").is_file():
        raise UserFileError(f"cannot resume {run_dir}: it holds no config.yaml (give a run directory, runs/NAME)")
    from asyncrl.configbase import apply_overrides

    data = apply_overrides(
        load_yaml(path / "config.yaml"), [*overrides, f"run.root={path.parent}", f"run.name={path.name}"]
    )
    return OfflineConfig(**data)
