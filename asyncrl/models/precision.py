"""Whether this process's device multiplies bfloat16 natively, and the dtypes ``*_if_native`` resolve to.

bf16 halves the memory of weights, activations and published versions, but it is only fast where
the hardware has bf16 dot-product instructions: CUDA GPUs of compute capability 8.0 and later,
and CPUs with AVX512-BF16 or AMX. On a CPU without them (AVX2 only, as many AMD EPYC and older
Xeon hosts) PyTorch and vLLM emulate bf16 matmuls: a 512 × 896 × 4864 product with its backward
took 8.8 s in bf16 against 0.28 s in fp32 on one such core (31×), and a learner step of a 0.5 B
model that takes 36 s on a CPU with native bf16 had not finished after 5 minutes.
``learner.trainer.dtype: bf16_if_native`` and ``engine.dtype: bfloat16_if_native`` pick bf16
where it is native and fp32 elsewhere, in the process that computes (a cluster's learner and
generators may sit on different hardware).
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of the instructions that make bf16 matmuls fast on a CPU."""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (empty if it has none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


@functools.cache
def native_bf16_cpu() -> bool:
    """Whether this host's CPU has AVX512-BF16 or AMX (False where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = cpu_flags(f.read())
    except OSError:
        return False
    return any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS)


def on_cuda(cuda: bool | None) -> bool:
    """``cuda``, or when None whether this process sees a CUDA device."""
    if cuda is not None:
        return cuda
    import torch

    return torch.cuda.is_available()


def native_bf16(cuda: bool | None = None) -> bool:
    """Whether the device this process computes on multiplies bf16 natively: the current CUDA
    device (compute capability >= 8.0) when ``cuda`` (None: when CUDA is available), else the CPU."""
    if on_cuda(cuda):
        import torch

        return torch.cuda.get_device_capability()[0] >= 8
    return native_bf16_cpu()


def resolve_trainer_dtype(dtype: str, cuda: bool | None = None) -> str:
    """``learner.trainer.dtype`` as the learner trains: ``bf16_if_native`` -> ``bf16`` where bf16
    is native (``native_bf16``), else ``fp32``; ``fp32`` and ``bf16`` unchanged."""
    return _resolve("learner.trainer.dtype", dtype, "bf16_if_native", "bf16", "fp32", cuda)


def resolve_engine_dtype(dtype: str, cuda: bool | None = None) -> str:
    """``engine.dtype`` as vLLM is given it: ``bfloat16_if_native`` -> ``bfloat16`` where bf16 is
    native (``native_bf16``), else ``float32``; every other value unchanged."""
    return _resolve("engine.dtype", dtype, "bfloat16_if_native", "bfloat16", "float32", cuda)


def _resolve(field: str, dtype: str, if_native: str, bf16: str, fp32: str, cuda: bool | None) -> str:
    """``dtype``, or when it is ``if_native`` the field's own name for bf16 or fp32 on this device (logged)."""
    if dtype != if_native:
        return dtype
    cuda = on_cuda(cuda)
    resolved = bf16 if native_bf16(cuda) else fp32
    log.info("%s %s: %s (%s)", field, if_native, resolved, _why(resolved, cuda))
    return resolved


def _why(resolved: str, cuda: bool) -> str:
    device = "the GPU" if cuda else "the CPU"
    if resolved.startswith("bf"):
        return f"{device} multiplies bf16 natively"
    if cuda:
        return "the GPU is older than sm_80: no bf16 tensor cores"
    return f"the CPU has none of the flags {', '.join(NATIVE_BF16_CPU_FLAGS)}: bf16 would be emulated"
