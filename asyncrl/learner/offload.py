"""The learner's optimizer and its offload at run time: the AdamW each engine steps
(``adamw_optimizer``), the ``zero_optimization`` keys that move its state and the parameters
(``offload_sections``), the NVMe swap folders, and DeepSpeed's async_io op with libaio.

What moves where (``learner.trainer.offload``, ``asyncrl.learner.offload_config``):

- ``optimizer: cpu`` (ZeRO-Offload): the fp32 master weights, Adam's m and v and (ZeRO-1/2) the
  fp32 gradient partitions live in host memory; after each backward the gradients are copied
  there, the AdamW update runs on the CPU, the new weights are copied back. The accelerator keeps
  the weights in the training dtype and the activations only.
- ``optimizer: nvme`` (ZeRO-Infinity, ZeRO-3): as cpu, with the fp32 state kept in files and
  streamed through host buffers a part at a time for the update.
- ``params: cpu | nvme`` (ZeRO-3): each rank's parameter shards live in host memory or files and
  are fetched for each layer's forward and backward.

The optimizer is torch's AdamW, as without offload, unless ``optimizer_impl`` asks for DeepSpeed's
CPU Adam; DeepSpeed refuses a client optimizer under offload unless ``zero_force_ds_cpu_optimizer``
is false, which ``offload_sections`` sets for torch's. Both are AdamW (decoupled weight decay,
Loshchilov & Hutter 2019) with eps 1e-8; their roundings differ in the last bits.

NVMe needs DeepSpeed's ``async_io`` op, compiled on first use against libaio's header and library.
Where the system has no libaio (no root, no package), ``scripts/setup.sh`` unpacks Debian's
``libaio1`` and ``libaio-dev`` into ``.tools/libaio`` (``apt-get download`` + ``dpkg-deb -x``);
``load_async_io`` points the compiler there (CPATH, LIBRARY_PATH, and CFLAGS/LDFLAGS for
DeepSpeed's own check) and loads the library into the process before the op, so the op finds it
without LD_LIBRARY_PATH. ``ASYNCRL_LIBAIO_DIR`` names another such folder.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import tempfile
from pathlib import Path

import torch

from asyncrl.learner.config import TrainerConfig

LIBAIO_DIR = Path(__file__).resolve().parents[2] / ".tools" / "libaio"
"""Where ``scripts/setup.sh`` unpacks libaio when the system has none (overridden by ``ASYNCRL_LIBAIO_DIR``)."""


def adamw_optimizer(params, cfg: TrainerConfig, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The AdamW that steps ``params``: torch's (fused when ``cfg.fused_adamw``), or DeepSpeed's CPU
    Adam when the offloaded update asks for it (``cfg.offload.optimizer_impl``)."""
    if cfg.offload.optimizer != "none" and cfg.offload.optimizer_impl == "deepspeed_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, betas=tuple(cfg.betas), weight_decay=weight_decay, adamw_mode=True)
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(cfg.betas), weight_decay=weight_decay, fused=cfg.fused_adamw or None
    )


def offload_sections(cfg: TrainerConfig, role: str) -> tuple[dict, dict]:
    """``(zero_optimization keys, top-level keys)`` of ``cfg.offload`` for the engine of ``role``
    ("policy", "critic"): empty when nothing is offloaded. An NVMe engine gets its own swap folder
    under ``nvme_path`` (``swap_folder``) and needs the async_io op, loaded here."""
    off = cfg.offload
    if not off.enabled:
        return {}, {}
    zero: dict = {}
    nvme_path = None
    if off.uses_nvme:
        load_async_io()
        nvme_path = swap_folder(Path(off.nvme_path), role)
    if off.optimizer != "none":
        zero["offload_optimizer"] = {"device": off.optimizer, "pin_memory": off.pin_memory}
        if off.optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = nvme_path
    if off.params != "none":
        zero["offload_param"] = {"device": off.params, "pin_memory": off.pin_memory}
        if off.params == "nvme":
            zero["offload_param"].update(
                nvme_path=nvme_path, max_in_cpu=off.max_in_cpu_params, buffer_size=off.nvme_buffer_elements
            )
    if cfg.zero_stage == 3:
        zero["sub_group_size"] = off.sub_group_elements
    top = {"zero_force_ds_cpu_optimizer": off.optimizer_impl == "deepspeed_cpu_adam"}
    return zero, top


def swap_folder(nvme_path: Path, role: str) -> str:
    """A fresh folder for one engine's swap files under ``nvme_path`` (created if missing), removed
    when the process exits: each engine (policy, critic, a second trainer in a test) swaps into its
    own, since DeepSpeed names the files by rank and parameter only."""
    nvme_path.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"asyncrl-{role}-{os.getpid()}-", dir=nvme_path)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def libaio_dir() -> Path | None:
    """The unpacked libaio folder (``ASYNCRL_LIBAIO_DIR``, else ``.tools/libaio``), or None when
    there is none and the system's is used."""
    root = Path(os.environ.get("ASYNCRL_LIBAIO_DIR", LIBAIO_DIR))
    return root if (root / "usr" / "include" / "libaio.h").exists() else None


def load_async_io():
    """DeepSpeed's async_io op, compiled on first use (~1-2 min, cached in torch's extension
    folder) against the system's libaio or the unpacked one (``libaio_dir``). Raises RuntimeError
    saying what is missing when libaio is in neither place."""
    from deepspeed.accelerator import get_accelerator

    root = libaio_dir()
    if root is not None:
        include = root / "usr" / "include"
        library = next((p.parent for p in root.glob("usr/lib/*/libaio.so.1")), None)
        if library is None:
            raise RuntimeError(f"{root} holds libaio.h but no usr/lib/*/libaio.so.1: unpack libaio1 beside libaio-dev")
        for key, value in (("CPATH", include), ("LIBRARY_PATH", library)):
            _prepend(key, str(value), ":")
        _prepend("CFLAGS", f"-I{include}", " ")  # DeepSpeed's compatibility check reads these two
        _prepend("LDFLAGS", f"-L{library}", " ")
        # The op's DT_NEEDED libaio.so.1 resolves to the copy already loaded, by its soname.
        ctypes.CDLL(str(library / "libaio.so.1"), mode=ctypes.RTLD_GLOBAL)
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        raise RuntimeError(
            "learner.trainer.offload nvme needs DeepSpeed's async_io op, which needs libaio's header and "
            f"library: none on the system and none unpacked in {LIBAIO_DIR} (scripts/setup.sh unpacks "
            "Debian's libaio1 and libaio-dev there; or install libaio-dev, or set ASYNCRL_LIBAIO_DIR)"
        )
    return builder.load(verbose=False)


def _prepend(key: str, value: str, sep: str) -> None:
    old = os.environ.get(key, "")
    if value not in old.split(sep):
        os.environ[key] = value + (sep + old if old else "")


def restore_swapped_optimizer(engine, load_dir: str | Path, tag: str) -> None:
    """Finish ``engine.load_checkpoint`` under NVMe optimizer offload (ZeRO-3). DeepSpeed 0.19.8
    then copies the swapped files (fp32 weights and moments) back into the swap folder and skips
    the rest of the optimizer's checkpoint, restoring neither the optimizer's per-parameter state
    (a fresh torch or CPU Adam has none until its first step, which would start new moments at
    step 0; a sub-group too small to swap keeps its moments and fp32 weights only in the
    checkpoint file) nor the training-dtype weights (the model would run its start-up weights).

    For each ZeRO sub-group: the optimizer's state from the rank's checkpoint file (the step
    count; the moments themselves, or, where they are swapped, full-size placeholders that the
    swap-in fills from the copied files), the fp32 weights likewise, then the model's partition
    (or its NVMe swap) set from them, as after an update. A no-op without NVMe optimizer offload."""
    if not engine.zero_nvme_offload_optimizer():
        return
    zero = engine.optimizer
    swapped_groups = [i for i in range(len(zero.fp32_partitioned_groups_flat)) if zero._swappable_optimizer_subgroup(i)]
    saved_files = Path(load_dir) / tag / "offloaded_tensors" / f"rank{engine.global_rank:02d}"
    _rename_swap_files(
        Path(zero.optimizer_swapper.swap_folder),
        saved_files,
        [zero.fp32_partitioned_groups_flat[i].ds_id for i in swapped_groups],
    )
    saved = torch.load(engine._get_zero_ckpt_name(str(load_dir), tag), map_location="cpu", weights_only=False)
    states = saved["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    fp32_saved = saved["optimizer_state_dict"]["fp32_flat_groups"]
    for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
        numel = int(zero.fp16_partitioned_groups_flat_numel[i])
        swapped = zero._swappable_optimizer_subgroup(i)
        state = {}
        for key, value in states[i].items():
            moment = torch.is_tensor(value) and value.numel() in (0, numel) and value.dim() == 1
            state[key] = torch.zeros(numel, dtype=flat.dtype) if swapped and moment else value
        zero.optimizer.state[flat] = state
        if swapped:
            zero._optimizer_states_and_gradient_swap_in(i)  # the weights and moments from their files
        else:
            flat.data.copy_(fp32_saved[i].data)
        zero._reassign_or_swap_out_partitioned_parameters(i)
        if swapped:
            zero._optimizer_states_and_gradient_swap_out(i)


def _rename_swap_files(swap_dir: Path, saved_files: Path, new_ids: list[str]) -> None:
    """Give the swap files copied from a checkpoint the ids of this engine's sub-groups.

    DeepSpeed names a sub-group's files by its id, the first and last ids of its parameters
    ("27_53.tensor.swp", "exp_avg-27_53.tensor.swp"), and ids count the parameters every engine
    of the process has built: an engine built after another (a second trainer in one process)
    has other ids than the one that saved. The saved ids, in order, are matched to ``new_ids``."""
    old_ids = sorted(
        {p.name.split(".")[0] for p in saved_files.glob("*.tensor.swp") if "-" not in p.name},
        key=lambda ds_id: int(ds_id.split("_")[0]),
    )
    if len(old_ids) != len(new_ids):
        raise RuntimeError(
            f"{saved_files} holds {len(old_ids)} swapped sub-groups, this engine has {len(new_ids)}: "
            "resume with the same model, ZeRO config and ranks"
        )
    moves = []
    for old, new in zip(old_ids, new_ids):
        if old != new:
            for path in swap_dir.glob(f"*{old}.tensor.swp"):
                if path.name == f"{old}.tensor.swp" or path.name.endswith(f"-{old}.tensor.swp"):
                    moves.append((path, swap_dir / path.name.replace(old, new)))
    staged = [(path.rename(path.with_suffix(".moving")), target) for path, target in moves]  # ids may overlap
    for path, target in staged:
        path.replace(target)
