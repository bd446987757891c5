"""GPU check: vLLM's own weight transfer (``ipc``, ``nccl``) timed on a CUDA host, written, not run here.

    python bench/vllm_weight_transfer_gpu.py --shape 7b --versions 3   # vLLM 0.32's CUDA build, 1 or 2 GPUs

The trainer (a transformers Qwen2 of ``--shape``, random, bfloat16, on cuda:0 in this process)
sends ``--versions`` versions to a vLLM engine started with dummy weights, through ``ipc`` (the
engine's core on the same GPU) and, with two GPUs, ``nccl`` (the engine on cuda:1), each built
with vLLM's trainer-side factory and driven by ``send_weights()``. Per version: seconds of
``send_weights`` (start, transfer and load, finish) and the prefix-cache reset, bytes per second,
and the mean |engine - trainer| logprob on a fixed token sequence (small: the engine serves the
trainer's weights; large before the first version: dummy weights). The CPU build cannot run it
(``bench/vllm_weight_transfer.py`` says why), and the GPU lent to this project has no vLLM in its
image: run it where vLLM's CUDA build is installed. One JSON object on stdout, also written to
bench/results/vllm_weight_transfer_gpu.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from vllm_weight_transfer import (  # noqa: E402  (bench/, beside this file)
    OUT,
    REPO,
    TEXT_IDS,
    close_llm,
    engine_logprobs,
    finish,
    free_port,
    header,
    hf_logprobs,
    start_llm,
)

sys.path.insert(0, str(REPO))

SHAPES = {  # TinyModelConfig fields: Qwen2.5's layer shapes
    "0.5b": dict(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944, vocab_size=152064
    ),
}


class OfflineClient:
    """``VLLMWeightSyncClient`` over an offline ``LLM`` in this process (its core in a child)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.llm.finish_weight_update(weight_version)


def run_gpu(args) -> dict:
    from transformers import Qwen2ForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from asyncrl.models.tiny import TinyModelConfig, qwen2_config

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process (IPC needs two)
    config = qwen2_config(TinyModelConfig(**SHAPES[args.shape], max_position_embeddings=256))
    config.dtype = "bfloat16"
    folder = Path(tempfile.mkdtemp(prefix="vllm_wt_gpu_"))
    config.save_pretrained(folder)
    torch.cuda.set_device(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: no float32 copy left cached on the GPU
    with torch.device("cuda:0"):
        trainer = Qwen2ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    backends = ["ipc"] + (["nccl"] if torch.cuda.device_count() > 1 else [])
    out = {"shape": args.shape, "parameters": sum(p.numel() for p in trainer.parameters()), "bytes": nbytes}
    for backend in backends:
        if backend == "nccl":  # the engine on the second GPU: its core process sees that one only
            os.environ["CUDA_VISIBLE_DEVICES"] = "1"
        llm = start_llm(
            folder, backend, load_format="dummy", skip_tokenizer_init=True, max_model_len=256,
            gpu_memory_utilization=0.4 if backend == "ipc" else 0.8,
        )  # fmt: skip
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0, packed=True)
        sender = WeightTransferTrainerFactory.trainer_init(
            info, client=OfflineClient(llm), source=ModuleSource(trainer)
        )
        rounds = []
        for version in range(1, args.versions + 1):
            with torch.no_grad():  # a stand-in for an optimizer step
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)
            torch.cuda.synchronize()
            t = time.perf_counter()
            sender.send_weights()
            llm.reset_prefix_cache()
            s = time.perf_counter() - t
            diff = (engine_logprobs(llm, TEXT_IDS) - hf_logprobs(trainer, TEXT_IDS)).abs().mean().item()
            rounds.append(
                {"version": version, "send_s": round(s, 4), "GB_per_s": round(nbytes / s / 1e9, 2), "diff": diff}
            )
        sender.shutdown()
        close_llm(llm)
        out[backend] = rounds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="the model's shape")
    parser.add_argument("--versions", type=int, default=3, help="versions sent per backend")
    parser.add_argument("--out", type=Path, default=OUT / "vllm_weight_transfer_gpu.json", help="the JSON's path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA and vLLM's CUDA build: bench/vllm_weight_transfer.py is the CPU check")
    results = header()
    results.update(run_gpu(args))
    finish(results, args.out)


if __name__ == "__main__":
    main()
