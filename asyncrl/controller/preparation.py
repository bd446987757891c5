"""What the controller prepares before any component starts: the run directory, the model RL
starts from, the environment every child gets, and how long they all have to start."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from asyncrl.config import RunConfig, dump_config
from asyncrl.controller.errors import RunError

log = logging.getLogger("asyncrl")


def prepare_run_dir(cfg: RunConfig) -> Path:
    """A fresh ``run.root/run.name`` holding the resolved config (an existing one is replaced
    only with ``run.overwrite``)."""
    run_dir = Path(cfg.run.root) / cfg.run.name
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise RunError(f"run directory {run_dir} exists and run.overwrite is false")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir.resolve()


def resume_run_dir(cfg: RunConfig) -> Path:
    """The existing run directory to resume; its resolved config is rewritten with ``cfg``."""
    run_dir = (Path(cfg.run.root) / cfg.run.name).resolve()
    if not (run_dir / "config.yaml").exists():
        raise RunError(f"cannot resume {run_dir}: it has no config.yaml (is it a run directory?)")
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "summary.json").unlink(missing_ok=True)  # written again when the resumed run ends
    return run_dir


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The policy RL starts from: a given model (a folder, or a known model's name, fetched into
    the cache when missing: ``asyncrl.models.fetch``), or the tiny model built here, warm-started by
    SFT: on prompt + answer, or, with ``environment.cls``, on the environment's demonstrations
    (``asyncrl.controller.demonstrations``)."""
    from asyncrl.models.fetch import resolve_model_path
    from asyncrl.models.sft import run_sft
    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.tasks.prompts import load_run_prompts

    if cfg.model.path is not None:
        base = resolve_model_path(cfg.model.path)
        log.info("model.path %s: %s", cfg.model.path, base)
    else:
        base = build_tiny_model(cfg.model.tiny.model_copy(update={"seed": cfg.run.seed}), run_dir / "model" / "base")
        log.info("built the tiny model in %s", base)
    if not cfg.model.warm_start:
        # Read (rendered and measured) as the SFT warm start reads them, though the dispatcher reads
        # them again: a missing file or a bad row found there would fail a child over and over;
        # found here, it ends the run in one line before any process starts.
        load_run_prompts(cfg, "train", base)
        return base
    warm = run_dir / "model" / "warm"
    examples = None
    if cfg.environment.cls is not None:
        # Episodes: the environment's demonstrations, in the tokens the generators will hold.
        from asyncrl.controller.demonstrations import load_demonstrations

        examples = load_demonstrations(cfg, base)
    one_math_thread()
    stats = run_sft(base, load_run_prompts(cfg, "train", base), cfg.sft, warm, examples)
    what = f"{cfg.environment.cls}'s demonstrations" if examples is not None else "prompt + answer"
    log.info(
        "SFT warm start on %s: %d steps, final loss %.3f, %.1f s",
        what,
        stats["steps"],
        stats["final_loss"],
        stats["seconds"],
    )
    return warm


def one_math_thread() -> None:
    """torch in the controller's own process (the SFT warm start, eval.engine hf) uses one
    thread, as every component does, whatever OMP_NUM_THREADS the caller had."""
    import torch

    torch.set_num_threads(1)


def held_out_prompts(cfg: RunConfig, model_dir: Path) -> list:
    """The first ``eval.num_prompts`` of the task's test split, rendered and measured as the
    engines take them (``asyncrl.tasks.prompts.load_run_prompts``): what every evaluation scores."""
    from asyncrl.tasks.prompts import load_run_prompts

    return load_run_prompts(cfg, "test", model_dir)[: cfg.eval.num_prompts]


def evaluate(cfg: RunConfig, model_dir: Path) -> float:
    """``eval.engine: hf``: Hugging Face greedy decoding on this CPU in float32 (small models only)."""
    from asyncrl.models.hf_eval import evaluate_exact_match

    one_math_thread()
    return evaluate_exact_match(
        model_dir, None, held_out_prompts(cfg, model_dir), max_new_tokens=cfg.eval.max_new_tokens
    )


def child_env(run_dir: Path) -> dict[str, str]:
    """Environment of every component: one math thread each, offline, temp files in the run
    (``run_dir/tmp``; when that path is too long for the Unix sockets vLLM and ZeroMQ make there,
    a short folder of the system's temp dir named by the run's path, ``short_tmp``)."""
    tmp = component_tmp(run_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TORCHDYNAMO_DISABLE="1",  # vLLM's CPU backend otherwise spends 15-20 s in g++ at start
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine in the generator's own process: 8 s, 1 GiB
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # two engines on one box must not pin to the same core
        DS_ACCELERATOR="cpu" if not _has_cuda() else env.get("DS_ACCELERATOR", "cuda"),
        TMPDIR=str(tmp),
        PYTHONUNBUFFERED="1",
    )
    # oneDNN (vLLM's CPU matmuls) keeps every primitive it compiles for a new input shape, 1,024
    # by default, and a generator meets a new token count at almost every step, so the cache
    # keeps filling for hours. vLLM keeps its own 32 per layer besides.
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))
    return env


TMP_PATH_MAX = 60
"""Longest temp dir the components are given: a Unix socket's path holds 107 bytes, and vLLM and
ZeroMQ name theirs with a 36-character uuid and a prefix inside it."""


def component_tmp(run_dir: Path) -> Path:
    """The components' temp dir: ``run_dir/tmp``, or ``short_tmp(run_dir)`` when that is too long."""
    tmp = run_dir / "tmp"
    return short_tmp(run_dir) if len(str(tmp.resolve())) > TMP_PATH_MAX else tmp


def remove_short_tmp(run_dir: Path) -> None:
    """Remove the run's ``short_tmp`` folder, if it was given one, once its components have exited.

    A temp dir inside the run goes with the run; one outside it would otherwise stay in /tmp
    after every long-named run. A resumed run makes it again."""
    tmp = component_tmp(run_dir)
    if tmp != run_dir / "tmp":
        shutil.rmtree(tmp, ignore_errors=True)


def short_tmp(run_dir: Path) -> Path:
    """A temp dir for a run whose own is too long (``TMP_PATH_MAX``): the same for the same run.

    >>> short_tmp(Path("/a/very/deep/run")) == short_tmp(Path("/a/very/deep/run"))
    True
    """
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    base = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())  # TMPDIR may be the long one
    return base / f"asyncrl-{digest}"


ONEDNN_PRIMITIVE_CACHE = 128
"""Primitives oneDNN keeps compiled in each component (its default: 1,024); the environment's own
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` wins."""


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def startup_bound(cfg: RunConfig, model_dir: Path) -> float:
    """Seconds every process has to report ready: ``run.startup_timeout_s`` plus
    ``run.startup_s_per_gib`` per GiB of the model's weight files (none for a simulated run)."""
    weights = 0
    if model_dir.is_dir():
        weights = sum(p.stat().st_size for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    return cfg.run.startup_timeout_s + cfg.run.startup_s_per_gib * weights / (1 << 30)
