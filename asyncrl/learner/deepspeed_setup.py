"""The learner's DeepSpeed set-up: the process group, the engine, its optimizer and learning rate.

One optimizer update per mini-batch, whatever its size: the DeepSpeed config has
``gradient_accumulation_steps = 1`` and ``train_micro_batch_size_per_gpu = micro_batch_size``,
and the caller owns the accumulation boundary: before each micro batch's backward it calls
``engine.set_gradient_accumulation_boundary(is_last_micro_batch)``, calls
``engine.backward(loss, scale_wrt_gas=False)``, and ``optimizer_update`` once at the end. The
boundary flag tells ZeRO-1/2 when to move the summed gradients into the optimizer's partitions
(and a multi-rank ZeRO-0 when to all-reduce); marking every micro batch a boundary makes stages
1 and 2 drift from a full-batch step, which ``tests/learner/trainer/test_zero_stages.py`` catches.

The learning rate is set by hand before each update from the schedule
(``asyncrl.learner.lr_schedule``) at the number of updates taken, rather than by a DeepSpeed
scheduler, so that a resume continues the schedule from the checkpoint's update count.
"""

from __future__ import annotations

import os
import sys
import weakref

import torch

from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.lr_schedule import lr_factor
from asyncrl.learner.offload import offload_sections
from asyncrl.wire.endpoints import free_ports


def init_learner_group(timeout_s: float, backend: str | None = None) -> None:
    """Join the learner's DeepSpeed process group (``deepspeed.init_distributed``).

    The launcher sets each rank's RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    (``asyncrl.fleet.launcher.learner_rank_env``); a process started otherwise (a test, a
    notebook) is a group of one on a free port. A collective waits at most ``timeout_s``
    (``learner.trainer.collective_timeout_s``). DeepSpeed's CPU shared-memory all-reduce kernel is
    never built: it serves only inference all-reduce, and compiling it takes 45-120 s on first
    use. ``backend`` defaults to nccl when CUDA is available, else gloo. Idempotent.
    """
    import datetime

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module whose build_shm_op is replaced)

    if torch.distributed.is_initialized() and deepspeed.comm.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_ports(1)[0])
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.distributed.is_initialized():
        # A world destroyed by another library in this process (vLLM's in-process engine does
        # when it closes) leaves DeepSpeed's clone of it cached; the new world needs its own.
        import deepspeed.utils.groups

        deepspeed.utils.groups._WORLD_GROUP = None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    # DeepSpeed makes groups of its own (a clone of the world, which its gradient collectives run
    # on) with new_group's default timeout, 30 minutes, not the world's: make ours the default.
    torch.distributed.distributed_c10d.default_pg_timeout = timeout
    torch.distributed.distributed_c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def deepspeed_config(cfg: TrainerConfig, role: str = "policy") -> dict:
    """The DeepSpeed config of the run's ZeRO stage, offload, precision and clipping for the
    engine of ``role`` ("policy", "critic": an NVMe offload swaps into a folder of its own): one
    micro batch per "DeepSpeed step" (the caller owns the accumulation boundary)."""
    zero_buckets = {}
    if cfg.zero_bucket_elements is not None:
        zero_buckets = {
            "reduce_bucket_size": cfg.zero_bucket_elements,
            "allgather_bucket_size": cfg.zero_bucket_elements,
        }
    zero_offload, top_offload = offload_sections(cfg, role)
    zero3 = cfg.zero3.deepspeed() if cfg.zero_stage == 3 else {}
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, **zero_buckets, **zero3, **zero_offload},
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **top_offload,
    }


def deepspeed_engine(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, cfg: TrainerConfig, role: str = "policy"
):
    """A DeepSpeed engine around ``model`` and ``optimizer`` (``offload.adamw_optimizer``) with
    ``deepspeed_config(cfg, role)`` (policy and critic alike; without optimizer, the ZeRO-3
    reference). Under ZeRO-1/2/3 in fp32 without offload the optimizer's master partition is the
    model's own storage (``fp32_master.share_fp32_master``)."""
    import deepspeed

    from asyncrl.learner.fp32_master import share_fp32_master
    from asyncrl.learner.heap import release_freed_memory

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, role))
    _ENGINES.add(engine)
    share_fp32_master(engine.optimizer)
    # DeepSpeed's flattening copies every parameter (or partition) into one buffer and frees
    # them: holes in the C heap that would otherwise stay resident (``heap``).
    release_freed_memory()
    return engine


_ENGINES: weakref.WeakSet = weakref.WeakSet()
"""The engines ``deepspeed_engine`` built in this process that are not released yet."""


def release_engine(engine) -> None:
    """Destroy ``engine``: its hooks on the model's modules and its optimizer's buffers.

    A DeepSpeed engine is never collected on its own: the hooks it leaves on the model's modules
    (ZeRO-3's gathering, the gradient hooks) hold it. Its buffers stay mapped with it: at ZeRO-3
    DeepSpeed's two reduce buckets of 5e8 elements are 2 GB of address space (4 GB in fp32),
    mostly untouched, so the resident set hardly shows them, yet the kernel counts every private
    writable page when the process forks: a process that built a dozen engines can no longer
    fork (ENOMEM) however much memory is free. The learner process builds its engines once and
    exits with them; a process that builds one after another (tests, a notebook, a sweep)
    releases each with this (``PolicyTrainer.close``) or all at once (``release_engines``)."""
    from asyncrl.learner.heap import release_freed_memory

    engine.destroy()
    _ENGINES.discard(engine)
    release_freed_memory()


def release_engines() -> int:
    """Release every engine this process built and has not released (``release_engine``); how many."""
    engines = list(_ENGINES)
    for engine in engines:
        release_engine(engine)
    return len(engines)


def set_scheduled_lr(engine, cfg: TrainerConfig, updates: int) -> float:
    """Set the optimizer's learning rate to the schedule's at update ``updates``; return it."""
    lr = cfg.lr * lr_factor(updates, cfg.lr_schedule, cfg.lr_warmup_steps, cfg.lr_decay_steps or 1, cfg.min_lr_ratio)
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    return lr


def optimizer_update(engine, cfg: TrainerConfig, updates: int) -> tuple[float, float]:
    """Optimizer update number ``updates`` on the accumulated gradients (clipped by DeepSpeed);
    returns its learning rate and the gradient norm before clipping, and sets the next update's
    rate (the caller counts the update)."""
    lr = set_scheduled_lr(engine, cfg, updates)
    own_grad_norm = None
    if cfg.zero_stage == 0 and cfg.dtype == "fp32":
        # DeepSpeed clips fp32 ZeRO-0 gradients without recording the norm; measure it here.
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        if grads:
            own_grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    engine.step()
    set_scheduled_lr(engine, cfg, updates + 1)
    grad_norm = own_grad_norm if own_grad_norm is not None else engine.get_global_grad_norm()
    if isinstance(grad_norm, torch.Tensor):
        grad_norm = grad_norm.item()
    return lr, float(grad_norm) if grad_norm is not None else float("nan")
