"""The learner's part of a checkpoint: the trainer's state, the running totals, the groups trained.

A checkpoint (``asyncrl.rundir.checkpoints``) is written in parts, one per role, into a staging
directory; the learner's part is ``learner/`` in it:

- the trainer's own state (``trainer.save_state``; for the ``PolicyTrainer``,
  ``save_policy_state``: DeepSpeed's checkpoint of the policy and the critic, the version, the
  optimizer updates taken, the KL coefficient, the RNG states; with LoRA the policy's part holds
  the adapter and its optimizer state only, not the frozen base);
- ``trained_ids.bin``: every group trained in the run's history, so a group dispatched again
  after a failure is not trained twice across a resume;
- ``learner_state.json``: the version and the ``Counters``, so a resumed run's totals continue,
  and under ``buffer.max_staleness: auto`` the staleness controller's state (its bound).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.learner.totals import Counters
from asyncrl.rundir.checkpoints import staging_dir
from asyncrl.rundir.ledger import GroupIdSet
from asyncrl.wire.messages import CheckpointPartEvent

if TYPE_CHECKING:
    from asyncrl.learner.context import LearnerContext
    from asyncrl.learner.staleness_control import AutoStaleness
    from asyncrl.learner.trainer_parts import TrainerParts


def save_learner_part(
    trainer, counters: Counters, trained_ids: GroupIdSet, out: Path, auto: AutoStaleness | None = None
) -> None:
    """Write the learner's part of a checkpoint into ``out`` (created if missing); ``auto``: the
    staleness controller, under ``buffer.max_staleness: auto``."""
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_state(out)
    (out / "trained_ids.bin").write_bytes(trained_ids.to_bytes())
    state = {
        "trained": counters.trained,
        "trained_with_reuse": counters.trained_with_reuse,
        "trained_tokens": counters.trained_tokens,
        "busy_s": counters.busy_s,
        "staleness_hist": {str(k): v for k, v in counters.staleness_hist.items()},
        "token_staleness_hist": {str(k): v for k, v in counters.token_staleness_hist.items()},
        "segments_hist": {str(k): v for k, v in counters.segments_hist.items()},
        "stale_tokens_masked": counters.stale_tokens_masked,
        "dropped": dict(counters.dropped),
    }
    saved = {"version": trainer.version, "counters": state}
    if auto is not None:
        saved["staleness_control"] = auto.controller.state()
    (out / "learner_state.json").write_text(json.dumps(saved))


def load_learner_part(trainer, counters: Counters, src: Path, auto: AutoStaleness | None = None) -> GroupIdSet:
    """Restore what ``save_learner_part`` wrote into ``trainer``, ``counters`` and ``auto`` (when
    the checkpoint has its state: one written without auto leaves it at its start); return the
    groups trained so far. The trainer's version and the saved one must agree."""
    trainer.load_state(src)
    state = json.loads((src / "learner_state.json").read_text())
    if int(state["version"]) != trainer.version:
        raise ValueError(f"{src}: learner_state.json says version {state['version']}, the trainer {trainer.version}")
    saved = state["counters"]
    counters.trained = saved["trained"]
    counters.trained_with_reuse = saved["trained_with_reuse"]
    counters.trained_tokens = saved["trained_tokens"]
    counters.busy_s = saved["busy_s"]
    counters.staleness_hist = Counter({int(k): v for k, v in saved["staleness_hist"].items()})
    counters.dropped = Counter(saved["dropped"])
    # checkpoints written before these counts existed have none
    counters.token_staleness_hist = Counter({int(k): v for k, v in saved.get("token_staleness_hist", {}).items()})
    counters.segments_hist = Counter({int(k): v for k, v in saved.get("segments_hist", {}).items()})
    counters.stale_tokens_masked = saved.get("stale_tokens_masked", 0)
    if auto is not None and "staleness_control" in state:
        auto.controller.load_state(state["staleness_control"])
    return GroupIdSet.from_bytes((src / "trained_ids.bin").read_bytes())


def checkpoint_due(cfg, version: int) -> bool:
    """Whether the learner checkpoints at ``version``: every ``checkpoint.every_steps`` steps,
    and at the last step (so a finished run can be resumed to train longer)."""
    every = cfg.checkpoint.every_steps
    return bool(every) and (version % every == 0 or version == cfg.learner.total_steps)


def checkpoint_if_due(
    ctx: LearnerContext, trainer, counters: Counters, trained_ids: GroupIdSet, auto: AutoStaleness | None = None
) -> None:
    """Save the learner's part into the staging directory of the trainer's version when
    ``checkpoint_due``; report it as a ``checkpoint_part`` event (rank 0, once every rank's
    DeepSpeed part is written: ``save_policy_state`` ends in a barrier)."""
    if not checkpoint_due(ctx.cfg, trainer.version):
        return
    start = time.monotonic()
    save_learner_part(trainer, counters, trained_ids, staging_dir(ctx.run_dir, trainer.version) / "learner", auto)
    ctx.emit(CheckpointPartEvent(part="learner", version=trainer.version, seconds=time.monotonic() - start))


def save_policy_state(trainer: TrainerParts, out_dir: str | Path) -> None:
    """Everything a resume needs to continue bit for bit: DeepSpeed's checkpoint of the policy
    (weights, optimizer moments, ZeRO partitions) and the critic's, the version, the optimizer
    updates taken (the learning-rate schedule's position), the KL controller's beta and the
    RNG states (each rank's own). Collective: every rank calls it; it returns once every rank's
    files are written."""
    import torch

    out = Path(out_dir)
    state = {"version": trainer.version, "updates": trainer.updates, "kl_coef": trainer.kl_controller.value}
    # LoRA: the base is frozen and is the starting model, read again on resume; only the adapter
    # and its optimizer state are saved.
    if trainer.lora is not None:
        from asyncrl.learner.adapter import adapter_only_checkpoint

        with adapter_only_checkpoint(trainer.engine):
            trainer.engine.save_checkpoint(str(out), tag="policy", client_state=state, exclude_frozen_parameters=True)
    else:
        trainer.engine.save_checkpoint(str(out), tag="policy", client_state=state)
    if trainer.critic is not None:
        trainer.critic.engine.save_checkpoint(str(out), tag="critic")
    torch.save(_rng_state(), out / _rng_file(torch.distributed.get_rank()))
    trainer.dp.barrier("checkpoint written", trainer.version)  # the part is whole once every rank's is


def load_policy_state(trainer: TrainerParts, in_dir: str | Path) -> None:
    """Restore what ``save_policy_state`` wrote (the same config, the same number of ranks)."""
    import torch

    from asyncrl.learner.deepspeed_setup import set_scheduled_lr
    from asyncrl.learner.offload import restore_swapped_optimizer

    src = Path(in_dir)
    if not (src / "policy").is_dir():
        raise FileNotFoundError(f"{src} holds no policy checkpoint (no {src / 'policy'} directory)")
    lora = trainer.lora is not None
    _, state = trainer.engine.load_checkpoint(str(src), tag="policy", load_module_strict=not lora)
    if state is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint 'policy' in {src}")
    restore_swapped_optimizer(trainer.engine, src, "policy")  # NVMe offload: what DeepSpeed leaves out
    trainer.version = int(state["version"])
    trainer.updates = int(state.get("updates", trainer.version))  # older checkpoints: one update per step
    set_scheduled_lr(trainer.engine, trainer.cfg, trainer.updates)
    trainer.kl_controller.value = float(state["kl_coef"])
    if trainer.critic is not None:
        trainer.critic.engine.load_checkpoint(str(src), tag="critic")
        restore_swapped_optimizer(trainer.critic.engine, src, "critic")
    rng = src / _rng_file(torch.distributed.get_rank())
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))


def _rng_file(rank: int) -> str:
    """Each rank's RNG states: ``rng.pt`` for rank 0 (the one-rank name), ``rng.rank{r}.pt`` else."""
    return "rng.pt" if rank == 0 else f"rng.rank{rank}.pt"


def _rng_state() -> dict:
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
