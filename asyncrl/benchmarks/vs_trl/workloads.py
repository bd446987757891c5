"""The work both sides are given: a recipe, the model it starts from, and asyncrl's modes.

A workload is an asyncrl recipe; trl's side reads the same recipe
(``asyncrl.benchmarks.vs_trl.trl_grpo``), so the model, task, prompts, rewards, sampling, batch,
learning rate and seeds are the same by construction. Every run of a workload starts from the
same model folder, prepared once before any clock starts (``start_model``): the demo's tiny
model warm-started exactly as ``make demo`` warms it, or a real model fetched into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import RunConfig, load_config

ASYNC_MODE: tuple[str, ...] = ()
"""asyncrl as the recipe says: generators run ahead of the learner within ``buffer.max_staleness``."""
SYNC_MODE = (
    "buffer.max_staleness=0",
    "learner.broadcast_every=1",
    "buffer.sampler=fifo",
    "algorithm.std_estimator=unbiased",
)
"""asyncrl on-policy with trl's objective: every batch sampled by the weights it trains (each
version published), every group trained in the order sampled (no priorities), advantages divided
by the unbiased group std as trl divides them. Loss aggregation, learning rate and schedule,
optimizer, clipping and seeds are the recipe's on both sides (``trl_objective`` maps them)."""
MODES = {"async": ASYNC_MODE, "sync": SYNC_MODE}


@dataclass(frozen=True)
class Workload:
    name: str
    recipe: str
    """The asyncrl recipe both sides read."""
    overrides: tuple[str, ...]
    """Dotted overrides applied on every side (the held-out curve's interval among them)."""
    about: str

    def config(self, mode: str = "async", extra: tuple[str, ...] = ()) -> RunConfig:
        """The run's config in ``mode`` (``async`` or ``sync``), checked as ``asyncrl train`` checks it."""
        return load_config(self.recipe, [*self.overrides, *MODES[mode], *extra])


WORKLOADS = {
    "demo": Workload(
        "demo",
        "configs/demo.yaml",
        ("eval.every_versions=20",),
        "the demo: a tiny Qwen2 warm-started on two-digit addition, 120 steps x 16 prompts x 8 answers "
        "of at most 4 tokens; learning is cheap and the answers short, so start-up and per-step "
        "overheads decide",
    ),
    "smollm2": Workload(
        "smollm2",
        "configs/grpo_smollm2_arithmetic.yaml",
        (
            "learner.total_steps=8",
            "learner.batch_groups=4",
            "sampling.max_tokens=128",
            "engine.max_model_len=320",
            "eval.num_prompts=48",
            "eval.max_new_tokens=128",
            "eval.samples_k=0",
            "eval.every_versions=4",
            "buffer.max_staleness=2",
        ),
        "a real pretrained model (SmolLM2-135M-Instruct, fp32) on the times table asked in words; "
        "answers of up to 128 tokens whose lengths are long-tailed (most stop after the number, "
        "some ramble to the limit), so generation is most of a synchronous step",
    ),
}


def start_model(workload: Workload, cache: Path) -> Path:
    """The model folder every run of ``workload`` starts from, prepared once (not timed).

    The demo's: its tiny model built and warm-started with the recipe's own seed and SFT
    settings, as the controller does (``asyncrl.controller.preparation.prepare_model``), kept in
    ``cache``. A recipe whose ``model.path`` names a model: that model, fetched when missing."""
    from asyncrl.controller.preparation import prepare_model
    from asyncrl.models.fetch import resolve_model_path

    cfg = workload.config()
    if cfg.model.path is not None and not cfg.model.warm_start:
        return Path(resolve_model_path(cfg.model.path))
    folder = cache / workload.name
    warm = folder / "model" / "warm"
    if not (warm / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        prepare_model(cfg, folder)
    return warm
