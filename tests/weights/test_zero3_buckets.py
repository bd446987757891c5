"""Bucketed ZeRO-3 gather on 2 processes (gloo on CPU): every rank iterates, rank 0 gets the
full weights bit-identically, and no more than one bucket is gathered at a time."""

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.wire.endpoints import free_ports


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    )


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    from asyncrl.weights.buckets import iter_buckets

    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    assert all(p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters())  # partitioned
    got, peak = {}, 0
    cap = 64 * 64 * 4 + 64 * 4  # one 64x64 layer with its bias
    for bucket in iter_buckets(engine.module, cap):
        whole = sum(p.numel() for p in engine.module.parameters() if p.numel() == p.ds_numel and p.ds_numel > 0)
        peak = max(peak, whole * 4)
        for name, t in bucket:
            got[name] = t.clone()
    if rank == 0:
        torch.save({"got": got, "expected": expected, "peak": peak, "cap": cap}, out)
    torch.distributed.barrier()
    # Left to the interpreter's exit, gloo's threads can be torn down still joinable (SIGABRT).
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_zero3_bucketed_gather_on_two_processes(tmp_path):
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank, args=(2, free_ports(1)[0], out), nprocs=2, join=True)
    result = torch.load(out)
    assert result["got"].keys() == result["expected"].keys()
    for name, t in result["expected"].items():
        assert torch.equal(result["got"][name], t), name
    assert 0 < result["peak"] <= result["cap"]  # never more than one bucket whole at a time
