"""The learner's offload section (``learner.trainer.offload``, ``OffloadConfig``): where DeepSpeed
keeps the optimizer state and, under ZeRO-3, the parameters between uses — the accelerator
(``none``), host memory (``cpu``) or files on a fast disk (``nvme``) — and which AdamW runs the
update there. Declarations only, beside ``trainer_config.py`` (which imports it); it imports only
configbase. ``check_offload`` holds the rules that involve the trainer's other keys (the ZeRO
stage, ``fused_adamw``); ``TrainerConfig`` runs it at load.

The keys are DeepSpeed's ``zero_optimization.offload_optimizer`` / ``offload_param`` (ZeRO-Offload,
Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021), written by
``asyncrl.learner.offload.offload_config``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.configbase import Config

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadConfig(Config):
    """Optimizer-state and parameter offload of the learner's DeepSpeed engines (policy and critic)."""

    optimizer: OffloadDevice = "none"
    """Where the optimizer's state lives and its update runs. none: with the parameters (on the
    accelerator). cpu: the fp32 master weights, Adam's two moments and, at ZeRO-1/2, the fp32
    gradient partitions are kept in host memory and the update runs on the CPU (ZeRO-Offload):
    12-16 bytes per parameter leave the accelerator, each step copies the gradients out and the
    updated weights back. nvme: as cpu, but the state is swapped to files under ``nvme_path`` and
    read back a part at a time for the update (ZeRO-Infinity; ZeRO-3 only). Needs zero_stage >= 1."""
    params: OffloadDevice = "none"
    """ZeRO-3 only: where each rank's parameter shards live between uses. cpu: in host memory,
    copied to the accelerator for each layer's forward and backward; nvme: in files under
    ``nvme_path``, at most ``max_in_cpu_params`` elements of them held in host memory. none: on the
    accelerator."""
    nvme_path: str | None = None
    """Folder on a fast local disk for the nvme swap files (a fresh sub-folder per engine and
    process, removed when the process exits; checkpoints copy the swapped state into the
    checkpoint). Needed when either device is nvme, and DeepSpeed's async_io op (libaio:
    ``scripts/setup.sh`` fetches it into ``.tools/libaio``)."""
    pin_memory: bool = True
    """Page-lock the host buffers that hold offloaded state, so copies to and from a GPU run at full
    bandwidth and overlap compute; costs unswappable host memory (the memlock limit, ``ulimit -l``).
    On a CPU-only learner DeepSpeed pins nothing, whatever this says."""
    optimizer_impl: Literal["torch", "deepspeed_cpu_adam"] = "torch"
    """The AdamW that runs the offloaded update. torch: torch.optim.AdamW (fused kernel when
    ``fused_adamw``), compiles nothing (DeepSpeed's ``zero_force_ds_cpu_optimizer: false``).
    deepspeed_cpu_adam: DeepSpeed's CPU Adam (SIMD, multi-threaded; the ``cpu_adam`` op,
    compiled with ninja and g++ on first use, 1-3 min), the one DeepSpeed recommends on GPU hosts;
    it has only a fused kernel, so it needs ``fused_adamw: true``. Used only when ``optimizer`` is
    cpu or nvme."""
    max_in_cpu_params: int = Field(1_000_000_000, ge=1)
    """params: nvme: elements of a rank's parameter partition DeepSpeed also keeps in a flat host
    buffer beside the files (``offload_param.max_in_cpu``). The default (DeepSpeed's 1e9) holds a
    whole partition below a billion elements, so NVMe then saves no host memory; lower it (1e7 in
    ``configs/rehearsal_1_5b.yaml``) for the parameters to leave host memory."""
    nvme_buffer_elements: int = Field(100_000_000, ge=1)
    """params: nvme: elements per swap buffer (DeepSpeed's ``offload_param.buffer_size``); the
    largest parameter must fit in one."""

    sub_group_elements: int = Field(1_000_000_000, ge=1)
    """Elements per optimizer sub-group (DeepSpeed's ``zero_optimization.sub_group_size``, ZeRO-3):
    the update runs one sub-group at a time, and under nvme each is swapped in through host
    buffers of its size (4 of them: weights, gradients, two moments), so this bounds the host
    memory the NVMe update takes (4 x 4 bytes x this); smaller means more, smaller file reads. The
    default (DeepSpeed's) exceeds most ranks' share, so the buffers are as large as the state they
    swap: at 0.41 B on one rank here NVMe saved nothing with it and 3.1 GiB with 1e8."""

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded."""
        return self.optimizer != "none" or self.params != "none"

    @property
    def uses_nvme(self) -> bool:
        """Whether a swap folder and the async_io op are needed."""
        return "nvme" in (self.optimizer, self.params)


def check_offload(offload: OffloadConfig, zero_stage: int, fused_adamw: bool) -> None:
    """Refuse the combinations DeepSpeed cannot run or would run otherwise than asked, naming the
    values and the rule."""
    prefix = "learner.trainer.offload"
    if offload.params != "none" and zero_stage != 3:
        raise ValueError(
            f"{prefix}.params ({offload.params}) needs zero_stage 3 (only ZeRO-3 partitions the parameters), got {zero_stage}"
        )
    if offload.optimizer != "none" and zero_stage < 1:
        raise ValueError(
            f"{prefix}.optimizer ({offload.optimizer}) needs zero_stage >= 1 (ZeRO-0 has no optimizer partition to move), got {zero_stage}"
        )
    if offload.optimizer == "nvme" and zero_stage != 3:
        # DeepSpeed's ZeRO-1/2 optimizer accepts nvme but keeps the state in host memory.
        raise ValueError(
            f"{prefix}.optimizer (nvme) needs zero_stage 3 (ZeRO-Infinity; at stages 1-2 DeepSpeed keeps the state in host memory), got {zero_stage}"
        )
    if offload.uses_nvme and not offload.nvme_path:
        raise ValueError(
            f"{prefix}.nvme_path ({offload.nvme_path}) must name a folder when optimizer or params is nvme"
        )
    if offload.optimizer_impl == "deepspeed_cpu_adam":
        if offload.optimizer == "none":
            raise ValueError(
                f"{prefix}.optimizer_impl (deepspeed_cpu_adam) runs an offloaded update: it needs optimizer cpu or nvme, got none"
            )
        if not fused_adamw:
            raise ValueError(
                f"fused_adamw (False) asks for torch's unfused AdamW, but {prefix}.optimizer_impl (deepspeed_cpu_adam) "
                "has only a fused kernel: set optimizer_impl torch, or fused_adamw true"
            )
