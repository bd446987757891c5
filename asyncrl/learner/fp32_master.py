"""ZeRO-1/2 in fp32 without a second copy of the weights: the optimizer's master partition is the
model's own.

DeepSpeed's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``, ``stage_1_and_2.py`` in 0.19.8)
flattens the model's parameters into one buffer per parameter group (``bit16_groups_flat``,
the parameters become views of it), cuts it into one partition per rank
(``parallel_partitioned_bit16_groups``), and gives the inner optimizer a *clone* of this rank's
partition in fp32 (``single_partition_of_fp32_groups``): the master weights, which the optimizer
updates and which ``step`` copies back into the model's partition before the all-gather. With
bf16 weights the master is needed (the update is taken in fp32). With fp32 weights it is the
same numbers held twice: a rank holds the model once more over its 1/N share, 1.4 GB on one
rank at a 0.36 B model.

``share_fp32_master`` makes the master partition a view of the model's own partition (the same
storage) when the weights are fp32 and the master is on the same device (no CPU offload). Then

- the optimizer updates the model's partition in place, and DeepSpeed's copy of the master
  into the model's partition copies a tensor onto itself (no change);
- everything that reads or writes the master (the gradient clipping, the checkpoint's
  ``single_partition_of_fp32_groups``, its restore with ``load_from_fp32_weights``, the
  ``_hp_mapping`` fragments that ``safe_get_full_fp32_param`` reads) sees the model's values,
  which were equal to the clone's at every point where DeepSpeed reads it: the numbers are
  unchanged bit for bit (``tests/learner/trainer/test_zero_stages.py``: the same weights as plain
  torch, and a resume that continues bit for bit).

ZeRO-3 keeps the same redundant copy: its ``_create_fp32_partitions`` means to reuse the
model's flat partition as the master when their dtype and device agree, but compares the
tensor's ``torch.device`` with the accelerator's device *name*, a string, which is never equal
(``torch.device("cpu") == "cpu"`` is False in torch 2.13), so it clones there too. The same
view is made there (``fp32_partitioned_groups_flat`` onto ``fp16_partitioned_groups_flat``).

It runs after the engine is built, so the clone exists for a moment: by then building the
flat buffer has already held the weights (ZeRO-3: the rank's share) twice, the parameters and
the buffer being filled, so the construction's peak does not rise; the steady state holds the
weights once. A checkpoint saves a copy of the partition, not the buffer it views
(``_save_masters_alone``). DeepSpeed has no
setting for this (its ``bf16_master_weights_and_grads`` is the other case, low-precision
masters). Where the master lives elsewhere (CPU offload, NVMe) or in another dtype (bf16
weights), nothing changes.
"""

from __future__ import annotations

import torch


def share_fp32_master(optimizer) -> int:
    """Point a fp32 ZeRO-1/2/3 optimizer's master partitions at the model's own partitions;
    return the bytes freed (0 where it does not apply: another optimizer, bf16 weights,
    offload, or already shared)."""
    freed = 0
    for i, (master, own) in enumerate(master_pairs(optimizer)):
        if master.dtype != torch.float32 or own.dtype != torch.float32 or master.device != own.device:
            continue
        if master.data_ptr() == own.data_ptr():
            continue
        if optimizer.optimizer.state.get(master):
            raise RuntimeError("share_fp32_master must run before the first optimizer step")
        if master.shape != own.shape or not torch.equal(master, own):
            raise RuntimeError(f"ZeRO group {i}: the fp32 master partition differs from the model's")
        freed += master.numel() * master.element_size()
        master.data = own.detach()  # the same tensor object (the inner optimizer's param), new storage
    if freed:
        if hasattr(optimizer, "single_partition_of_fp32_groups"):
            optimizer._link_all_hp_params()  # ZeRO-1/2: its fragments were views of the freed clone
        _save_masters_alone(optimizer)
    return freed


MASTER_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups")
"""The keys under which DeepSpeed's ZeRO-1/2 and ZeRO-3 optimizers put the master partitions
in their checkpoint (``deepspeed.checkpoint.constants``)."""


def _save_masters_alone(optimizer) -> None:
    """Make the optimizer's ``state_dict`` hand out copies of its master partitions.

    ``torch.save`` writes a view's whole storage: the master partition, now a view of the
    model's flat buffer (the whole model under ZeRO-1/2), would write that buffer into every
    rank's optimizer file. DeepSpeed saves the ZeRO state dict without its
    ``clone_tensors_for_torch_save``; the copies (the rank's partitions, while a checkpoint is
    written) keep each file what it was."""
    original = optimizer.state_dict

    def state_dict(*args, **kwargs):
        state = original(*args, **kwargs)
        for key in MASTER_KEYS:
            if key in state:
                state[key] = [t.clone() if torch.is_tensor(t) else t for t in state[key]]
        return state

    optimizer.state_dict = state_dict


def master_pairs(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(master partition, the model's partition)`` of each parameter group of a ZeRO optimizer
    that keeps both on the same device; [] for any other (ZeRO-0, no optimizer, offload)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if optimizer.cpu_offload:
            return []
        groups = optimizer.single_partition_of_fp32_groups
        return [(master, own_partition(optimizer, i)) for i, master in enumerate(groups)]
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        if optimizer.offload_optimizer or optimizer.offload_param or optimizer.swap_optimizer:
            return []
        return list(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat))
    return []


def own_partition(optimizer, group: int) -> torch.Tensor:
    """This rank's partition of the model's flat buffer of parameter group ``group`` (ZeRO-1/2)."""
    import deepspeed.comm as dist

    rank = dist.get_rank(group=optimizer.real_dp_process_group[group])
    return optimizer.parallel_partitioned_bit16_groups[group][rank]


def fp32_master_shares_storage(optimizer) -> bool | None:
    """Whether every master partition of a ZeRO-1/2/3 optimizer is the model's own storage; None
    for an optimizer that keeps no master partitions beside the model's (ZeRO-0, none)."""
    pairs = master_pairs(optimizer)
    if not pairs:
        return None
    return all(master.data_ptr() == own.data_ptr() for master, own in pairs)
