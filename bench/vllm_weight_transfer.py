"""Check: vLLM's native weight-transfer API (``vllm.distributed.weight_transfer``) on this host.

    OMP_NUM_THREADS=1 flock /tmp/asyncrl-heavy.lock .venv/bin/python bench/vllm_weight_transfer.py

vLLM 0.32 lets a trainer push weights into a running engine through a four-phase protocol
(``init_weight_transfer_engine`` once, then per version ``start_weight_update``, one or more
``update_weights``, ``finish_weight_update(weight_version)``), its data plane chosen by
``WeightTransferConfig(backend=...)``: ``nccl`` (a broadcast group of the trainer and every
engine worker), ``ipc`` (CUDA IPC handles, trainer and engine on the same GPU), ``sparse_nccl``,
``nccl_m2n`` (NCCL's M-to-N resharding), ``sharded_rdt`` (Ray Direct Transport over NIXL) and
``modelexpress``; a backend can also be registered (``WeightTransferEngineFactory``).

On the CPU build (one engine at a time, in this process):

- ``backends``: each built-in backend tried as far as it goes, engine and trainer side, the
  exception it stops at recorded (``stage``, ``error``);
- ``protocol``: the four phases through a backend registered here (``FileTransferEngine``: reads
  a safetensors file, loads it with vLLM's layerwise reload), on the tiny model: seconds per
  version, and the served logprobs of a fixed text against transformers' on the new weights;
  beside it asyncrl's own path on the same engine (``collective_rpc`` of the worker's
  ``reload_weights``, as ``asyncrl.generators.engines.vllm_engine`` does).

On a CUDA host, ``bench/vllm_weight_transfer_gpu.py`` times vLLM's own ``ipc`` and ``nccl``.
One JSON object on stdout, also written to bench/results/vllm_weight_transfer.json.
"""

from __future__ import annotations

import os

for _k, _v in {
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

OUT = REPO / "bench" / "results"
TEXT_IDS = [5, 17, 42, 8, 99, 3, 61, 27, 11, 74, 36, 50]  # the probe's token ids: below any shape's vocabulary
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
"""The model of the CPU checks (TinyModelConfig fields)."""


# ---------------------------------------------------------------------------------------------
# a backend registered from outside vLLM: the native protocol with a data plane that needs no GPU


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the trainer names a file per update."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """A safetensors file of (HF name, tensor) to load."""


class FileTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """The engine side of a ``file`` backend: each ``update_weights`` loads one safetensors file.

    ``update_weights`` is overridden because the base class ends it with
    ``torch.accelerator.synchronize()``, which raises on a host without an accelerator
    ("Cannot access accelerator device when none is available"): without this override no
    backend, registered or built in, completes an update on the CPU build."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors.torch import load_file

        self.model.load_weights(iter(load_file(update_info.path).items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from asyncrl.generators.engines.tied_head import refresh_tied_head

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_head(self.model)  # as asyncrl's reload does: the CPU backend's packed tied head

    def shutdown(self) -> None:
        pass


def register_file_backend() -> None:
    """Register ``file`` with vLLM's factory in this process (the engine must run in it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "file" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("file", FileTransferEngine)


# ---------------------------------------------------------------------------------------------
# helpers


def failure(stage: str, call) -> dict:
    """Run ``call``; ``{stage, ok: True}`` or the exception it raised, named."""
    try:
        call()
    except Exception as e:  # the point is to record what each backend stops at
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return {
            "stage": stage,
            "ok": False,
            "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
            "raised_at": f"{Path(frame.filename).name}:{frame.lineno}",
        }
    return {"stage": stage, "ok": True}


def start_llm(model_dir: Path, backend: str | None, **extra):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    wt = None if backend is None else WeightTransferConfig(backend=backend)
    return LLM(model=str(model_dir), enforce_eager=True, seed=0, weight_transfer_config=wt, **extra)


def close_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def engine_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1,) the engine's logprobs of ``ids[1:]``, each given the tokens before it."""
    from vllm import SamplingParams, TokensPrompt

    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False),
        use_tqdm=False,
    )
    return torch.tensor([lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])])


def next_token_diff(llm, hf, ids: list[int]) -> float:
    """Mean |engine - transformers| over the engine's top 5 logprobs of the token after ``ids``:
    a prefix-cache hit shows here (the request reuses cached blocks; prompt logprobs do not)."""
    from vllm import SamplingParams, TokensPrompt

    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=1, logprobs=5, seed=0, detokenize=False),
        use_tqdm=False,
    )
    top = out.outputs[0].logprobs[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    return sum(abs(lp.logprob - ref[t].item()) for t, lp in top.items()) / len(top)


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], device=model.device)
    logits = model(x).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0].cpu()


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------
# CPU


class StubClient:
    """A ``VLLMWeightSyncClient`` that records calls: the trainer side must fail before any."""

    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")


def trainer_side(backend: str) -> dict:
    """The trainer engine of ``backend`` built on a small module, as a trainer would."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
    else:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=0)
    client = StubClient()
    source = ModuleSource(torch.nn.Linear(4, 4))
    out = failure("trainer_init", lambda: WeightTransferTrainerFactory.trainer_init(info, client=client, source=source))
    return {**out, "client_calls": client.calls}


def engine_side_stub(backend: str) -> dict:
    """The engine side of ``backend`` without an engine (its class on a stub config): the same
    calls the worker makes, for the fast tests."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=backend), config, torch.device("cpu"), torch.nn.Linear(4, 4)
    )
    if backend in ("nccl", "sparse_nccl"):
        init = dict(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2)
        return failure("init_weight_transfer_engine", lambda: engine.init_transfer_engine(engine.parse_init_info(init)))
    update = dict(names=["weight"], dtype_names=["float32"], shapes=[[4, 4]], ipc_handles=[{"gpu": ()}])
    return failure("update_weights", lambda: engine.update_weights(update))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_side(model_dir: Path, backend: str, extra: dict) -> dict:
    """``backend`` on a real engine: start it, then init (and for ipc one update)."""
    out = {"backend": backend}
    holder = {}
    out["start"] = failure("engine start", lambda: holder.setdefault("llm", start_llm(model_dir, backend, **extra)))
    llm = holder.get("llm")
    if llm is None:
        return out
    steps = []
    if backend == "nccl":  # the trainer's end of the rendezvous in a thread: both must arrive
        port = free_port()
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        trainer = threading.Thread(
            target=lambda: failure(
                "trainer", lambda: trainer_init(dict(master_address="127.0.0.1", master_port=port, world_size=2))
            ),
            daemon=True,
        )
        trainer.start()
        init = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
        steps.append(
            failure("init_weight_transfer_engine", lambda: llm.init_weight_transfer_engine({"init_info": init}))
        )
        trainer.join(30)
    else:
        steps.append(failure("init_weight_transfer_engine", lambda: llm.init_weight_transfer_engine({"init_info": {}})))
        steps.append(failure("start_weight_update", llm.start_weight_update))
        update = dict(names=["lm_head.weight"], dtype_names=["float32"], shapes=[[4, 4]], ipc_handles=[{"gpu": ()}])
        steps.append(failure("update_weights", lambda: llm.update_weights({"update_info": update})))
    out["steps"] = steps
    close_llm(llm)
    return out


def optional_backends() -> dict:
    """What the other built-in backends need that this host lacks (their own import checks), and
    vLLM's NCCL library, which ``nccl`` and ``sparse_nccl`` would load past the device check."""
    out = {}
    from vllm.distributed.weight_transfer.m2n_common import import_m2n

    out["nccl_m2n"] = failure("import", import_m2n)
    out["modelexpress"] = failure("import", lambda: __import__("vllm.distributed.weight_transfer.modelexpress_engine"))
    out["sharded_rdt"] = failure("import nixl", lambda: __import__("nixl"))
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    out["nccl_library"] = failure("NCCLLibrary()", NCCLLibrary)  # what nccl would meet past the device check
    out["torch_nccl_available"] = torch.distributed.is_nccl_available()
    return out


def protocol(model_a: Path, model_b: Path, versions: int, extra: dict) -> dict:
    """The four phases through the registered ``file`` backend, and asyncrl's reload beside it.

    First, whether the protocol drops the prefix cache: a text long enough to fill cache blocks
    is scored on the old weights, the new ones loaded (start, update, finish), the text scored
    again, then again after ``reset_prefix_cache``."""
    from asyncrl.generators.engines.tied_head import reload_weights

    register_file_backend()
    llm = start_llm(model_a, "file", enable_prefix_caching=True, block_size=32, **extra)
    hf_b = hf_model(model_b)
    ref_b = hf_logprobs(hf_b, TEXT_IDS)
    long_ids = (TEXT_IDS * 3)[:33]  # a full block of 32 (the CPU backend's multiple), and one token
    served_a = engine_logprobs(llm, TEXT_IDS)
    noise = (served_a - hf_logprobs(hf_model(model_a), TEXT_IDS)).abs().mean().item()  # numerics alone
    before = (served_a - ref_b).abs().mean().item()
    next_token_diff(llm, hf_b, long_ids)  # its full blocks now cached, computed by the old weights
    llm.init_weight_transfer_engine({"init_info": {}})
    update = {"update_info": {"path": str(model_b / "model.safetensors")}}
    llm.start_weight_update()
    llm.update_weights(update)
    llm.finish_weight_update("1")
    cached = next_token_diff(llm, hf_b, long_ids)
    llm.reset_prefix_cache()
    reset = next_token_diff(llm, hf_b, long_ids)
    native, ours = [], []
    for version in range(2, versions + 2):
        t = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights(update)
        llm.finish_weight_update(str(version))
        llm.reset_prefix_cache()
        native.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.collective_rpc(lambda w, p=str(model_b): reload_weights(w, weights_path=p))
        llm.reset_prefix_cache()
        ours.append(time.perf_counter() - t)
    # the last load was asyncrl's: load through the protocol once more, then score
    llm.start_weight_update()
    llm.update_weights(update)
    llm.finish_weight_update(str(versions + 2))
    llm.reset_prefix_cache()
    after = (engine_logprobs(llm, TEXT_IDS) - ref_b).abs().mean().item()
    served = llm.get_weight_version()
    close_llm(llm)
    return {
        "backend": "file (registered here)",
        "versions": versions,
        "native_s": [round(s, 4) for s in native],
        "asyncrl_reload_s": [round(s, 4) for s in ours],
        "mean_abs_logprob_diff_vs_new_weights": {"before": before, "after": after, "noise_on_old_weights": noise},
        "prefix_cache_after_finish": {"cached_text_diff": cached, "after_reset_diff": reset},
        "weight_version_served": served,
    }


def run_cpu(args) -> dict:
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    extra = dict(max_model_len=64, kv_cache_memory_bytes=64 << 20)
    root = Path(tempfile.mkdtemp(prefix="vllm_wt_", dir=os.environ.get("TMPDIR")))
    shape = TINY
    model_a = build_tiny_model(TinyModelConfig(**shape, seed=0), root / "a")
    model_b = build_tiny_model(TinyModelConfig(**shape, seed=1), root / "b")
    out = {"trainer": {b: trainer_side(b) for b in ("nccl", "ipc")}}
    out["engine"] = [engine_side(model_a, b, extra) for b in ("nccl", "ipc")]
    out["engine_stub"] = {b: engine_side_stub(b) for b in ("nccl", "sparse_nccl", "ipc")}
    out["other_backends"] = optional_backends()
    out["protocol"] = protocol(model_a, model_b, args.versions, extra)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=3, help="versions sent through the protocol")
    parser.add_argument("--out", type=Path, default=OUT / "vllm_weight_transfer.json", help="the JSON's path")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a registered backend lives in this process
    results = header()
    results.update(run_cpu(args))
    finish(results, args.out)


def header() -> dict:
    import vllm

    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_before": os.getloadavg(),
        "started": time.time(),
    }


def finish(results: dict, out: Path) -> None:
    results["wall_s"] = round(time.time() - results.pop("started"), 1)
    results["load_average_after"] = os.getloadavg()
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
