"""The learner's trainer, from the run's config: the real ``PolicyTrainer`` or a simulated one.

The trainer's config is completed from other sections here, where the whole run's config is at
hand: the learner scores tokens under the distribution they were sampled from (``sampling``'s
temperature, top-k, top-p), the learning-rate schedule decays over every optimizer update of the
run (``learner.total_steps × learner.updates_per_step``) unless told otherwise, and the loss's
length constant and the truncation limit default to ``sampling.max_tokens``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.learner.mock_trainer import MockTrainer
    from asyncrl.learner.trainer import PolicyTrainer


def build_trainer(cfg: RunConfig, model_dir: str, reference_address: str | None) -> PolicyTrainer | MockTrainer:
    """A ``MockTrainer`` when ``simulation.learner`` is set, else a ``PolicyTrainer`` on
    ``model_dir`` (``reference_address``: the KL reference process, for ``kl.reference: process``)."""
    sampling = cfg.sampling  # the learner scores tokens under the distribution they were sampled from
    trainer_cfg = cfg.learner.trainer.model_copy(
        update={
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "lr_decay_steps": cfg.learner.trainer.lr_decay_steps
            or cfg.learner.total_steps * cfg.learner.updates_per_step,
        }
    )
    if cfg.simulation.learner is not None:
        from asyncrl.learner.mock_trainer import MockTrainer

        return MockTrainer(cfg.simulation.learner)
    from asyncrl.learner.trainer import PolicyTrainer  # DeepSpeed loads only where it trains

    algo = cfg.algorithm
    if algo.loss_norm_tokens is None:
        algo = algo.model_copy(update={"loss_norm_tokens": cfg.sampling.max_tokens})
    if algo.truncation.max_tokens is None:
        truncation = algo.truncation.model_copy(update={"max_tokens": cfg.sampling.max_tokens})
        algo = algo.model_copy(update={"truncation": truncation})
    return PolicyTrainer(
        model_dir,
        trainer_cfg,
        algo,
        reference_address=reference_address,
        ppo_epochs=cfg.learner.ppo_epochs,
        mini_batches=cfg.learner.mini_batches,
        lora=cfg.model.lora,
        sequence_parallel=cfg.learner.sequence_parallel,
    )
