"""GPU memory gauges on a real CUDA device (imports nothing but the metrics module and torch)."""

import pytest

import asyncrl.observability.metrics as m


@pytest.mark.gpu
def test_gpu_memory_gauges_follow_cuda_allocations():
    import torch

    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sample = lambda name: m.REGISTRY.get_sample_value(name, {"device": "0"})  # noqa: E731
    assert sample("asyncrl_gpu_memory_allocated_bytes") >= block.numel()
    assert sample("asyncrl_gpu_memory_reserved_bytes") >= sample("asyncrl_gpu_memory_allocated_bytes")
    assert sample("asyncrl_gpu_memory_total_bytes") == torch.cuda.get_device_properties(0).total_memory
    del block
    torch.cuda.empty_cache()
    assert sample("asyncrl_gpu_memory_reserved_bytes") < 256 << 20
