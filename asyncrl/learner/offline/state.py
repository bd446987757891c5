"""Checkpoints of an offline run, and its resume, bit for bit.

A checkpoint is a run checkpoint of ``asyncrl.rundir.checkpoints`` with one part, ``learner/``:
DeepSpeed's checkpoint of the policy under the tag ``policy`` (weights, optimizer moments, ZeRO
partitions: what ``asyncrl export RUN_DIR --step N`` consolidates), with the steps and optimizer
updates taken as its client state, and each rank's RNG states (``rng.pt``, ``rng.rank{r}.pt``).
It is staged, then committed by rank 0 (manifest with checksums, one rename, ``latest``), so a
crash leaves the whole checkpoint or none, and a resume takes the newest one that verifies.

Why a resume is bit for bit: the batch of step s is a pure function of (seed, s)
(``asyncrl.learner.offline.loop.batch_indices``), the learning rate of the schedule's update
index, saved here, and the optimizer's state and the RNGs are restored exactly;
``tests/learner/offline/test_resume.py`` compares the weights of a resumed run with an
uninterrupted one.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from asyncrl.learner.data_parallel import DataParallel
from asyncrl.learner.offload import restore_swapped_optimizer
from asyncrl.rundir.checkpoints import commit, latest_checkpoint, staging_dir

TAG = "policy"
"""The DeepSpeed tag ``asyncrl export`` reads."""


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng.rank{rank}.pt"


def save_checkpoint(
    engine, run_dir: Path, step: int, updates: int, keep_last: int, dp: DataParallel, lora: bool = False
) -> Path | None:
    """Stage every rank's part of the checkpoint of ``step`` and commit it (rank 0); collective.
    ``lora``: the checkpoint holds the adapters, not the frozen base (``adapter_only_checkpoint``)."""
    out = staging_dir(run_dir, step) / "learner"
    client_state = {"step": step, "updates": updates}
    if lora:
        from asyncrl.learner.adapter import adapter_only_checkpoint

        with adapter_only_checkpoint(engine):
            engine.save_checkpoint(str(out), tag=TAG, client_state=client_state, exclude_frozen_parameters=True)
    else:
        engine.save_checkpoint(str(out), tag=TAG, client_state=client_state)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(state, out / _rng_file(dp.rank))
    dp.barrier("checkpoint written", step)
    final = commit(run_dir, step, ["learner"], {"kind": "offline"}, keep_last) if dp.lead else None
    dp.barrier("checkpoint committed", step)
    return final


def load_checkpoint(engine, run_dir: Path, dp: DataParallel, lora: bool = False) -> tuple[int, int]:
    """Restore the newest verified checkpoint into ``engine`` and the RNGs; (steps, updates) taken.
    (0, 0) when the run has none."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return 0, 0
    # With LoRA the checkpoint holds the adapters only: the base comes from the starting model.
    _, state = engine.load_checkpoint(str(path / "learner"), tag=TAG, load_module_strict=not lora)
    if state is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {TAG!r} in {path / 'learner'}")
    restore_swapped_optimizer(engine, path / "learner", TAG)  # NVMe offload: what DeepSpeed leaves out
    rng = path / "learner" / _rng_file(dp.rank)
    if rng.exists():
        saved = torch.load(rng, weights_only=False)
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
    return int(state["step"]), int(state["updates"])
