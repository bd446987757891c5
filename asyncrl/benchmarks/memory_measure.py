"""Measured peak memory of learner ranks, beside the memory model's prediction.

On the CPU the device is the host, so a rank's memory is its process's resident set. Each rank
runs in a fresh process (``python -m asyncrl.benchmarks.memory_measure``, started by
``measure``), as the launcher starts learner ranks, and records:

- ``baseline``: its RSS once torch, transformers and DeepSpeed are imported, before any model;
- ``load_peak``: the RSS high-water mark (``VmHWM``) through ``PolicyTrainer``'s construction
  (the fp32 model loaded whole, then DeepSpeed's engine), over the baseline;
- ``train_peak``: the high-water mark through ``steps`` learner steps (reset through
  ``/proc/self/clear_refs`` once the trainer is built; the first step allocates AdamW's moments),
  over the baseline: the number the model's training peak predicts (``device`` + ``host``
  components: one memory here). On a GPU (``device="cuda"``) the same figures come from the CUDA
  allocator's statistics, against the device components alone.

glibc keeps freed blocks below its mmap threshold in its heaps, so a resident set measures what
the allocator once held rather than what the tensors hold; the ranks run with
``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor of 64 KiB or more is mapped and unmapped on free)
so that the resident set follows the live tensors, as a GPU allocator's ``max_memory_allocated``
does. The prediction has no term for what the process allocates besides tensors (gloo's buffers,
Python objects of the engine: tens of MB), which the small checks' tolerance allows for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from asyncrl.benchmarks.memory_model import LearnerSetup, phase_peak, predict
from asyncrl.benchmarks.model_shapes import ModelShape

RANK_TIMEOUT_S = 1800
"""Seconds a group of ranks may take to load, step and report (a 0.5 B model's step is ~30 s here)."""
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def build_model(shape: ModelShape, out_dir: Path) -> Path:
    """A randomly initialised Qwen2 of ``shape`` (fp32, the character tokenizer padded to its
    vocabulary) in ``out_dir``."""
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    if not shape.qkv_bias:
        raise ValueError(f"shape {shape.name}: only Qwen2 shapes (q/k/v biases) are built here")
    cfg = TinyModelConfig(
        hidden_size=shape.hidden,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=8192,
    )
    return build_tiny_model(cfg, out_dir)


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _groups(setup: LearnerSetup, vocab: int, rank_groups: int) -> list:
    """One group of ``micro_batch`` answers per rank: prompt + response = seq_len tokens each."""
    import numpy as np

    from asyncrl.wire.schema import Group, Sample

    response = max(1, round(setup.seq_len * setup.scored_fraction))
    prompt = setup.seq_len - response
    rng = np.random.default_rng(0)
    groups = []
    for g in range(rank_groups):
        samples = [
            Sample(
                f"g{g}/{i}",
                rng.integers(3, vocab, response).astype(np.int32),
                np.full(response, -np.log(vocab), np.float32),
                "",
                "stop",
                float(i % 2),
            )
            for i in range(setup.micro_batch)
        ]
        groups.append(
            Group(f"g{g}", f"p{g}", "t", "", "", rng.integers(3, vocab, prompt).astype(np.int32), 0, "gen", samples)
        )
    return groups


def trainer_extras(setup: LearnerSetup, scratch: Path) -> dict:
    """``TrainerConfig`` keys for the rest of ``setup``: offload (``learner.trainer.offload``, its
    NVMe files under ``scratch``), ZeRO-3's gathering (``learner.trainer.zero3``) and the attention
    implementation."""
    extras: dict = {}
    if setup.optimizer_offload != "none" or setup.param_offload != "none":
        extras["offload"] = {
            "optimizer": setup.optimizer_offload,
            "params": setup.param_offload,
            "sub_group_elements": setup.sub_group_elements,
            "nvme_buffer_elements": setup.nvme_buffer_elements,
            "max_in_cpu_params": setup.max_in_cpu_params,
        }
        if "nvme" in (setup.optimizer_offload, setup.param_offload):
            extras["offload"]["nvme_path"] = str(scratch / "nvme")
    if setup.zero_stage == 3:
        extras["zero3"] = {
            "prefetch_elements": setup.prefetch_elements,
            "max_live_elements": setup.max_live_parameters,
            "max_reuse_elements": setup.max_reuse_distance,
            "persistence_threshold": setup.persistence_threshold,
        }
    if setup.attention != "sdpa":
        extras["attn_implementation"] = {"flash": "flash_attention_2"}.get(setup.attention, setup.attention)
    if setup.sequence_parallel != 1:
        raise ValueError(f"sequence_parallel ({setup.sequence_parallel}): the measurement runs one rank per sequence")
    return extras


def as_trained(setup: LearnerSetup) -> LearnerSetup:
    """``setup`` with the two terms the trainer decides rather than its config: a ZeRO-3 model
    is built partitioned (``partitioned_load``), and an fp32 master beside fp32 weights exists
    only where the optimizer's state is offloaded (``fp32_master.share_fp32_master`` shares it
    otherwise)."""
    return replace(
        setup,
        partitioned_load=setup.zero_stage == 3,
        fp32_master_when_fp32=setup.optimizer_offload != "none",
    )


def rank_main(model_dir: Path, setup: LearnerSetup, steps: int, out: Path) -> None:
    """One rank (RANK/WORLD_SIZE/MASTER_* from the environment): build, step, write its figures."""
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (the trainer imports it: ~100 MB of code and tables)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.deepspeed_setup import init_learner_group
    from asyncrl.learner.trainer import PolicyTrainer

    init_learner_group(600.0)
    cuda = torch.cuda.is_available()

    def held() -> int:  # the device's bytes: the CUDA allocator's, or the process's resident set
        return torch.cuda.memory_allocated() if cuda else _status_bytes("VmRSS")

    def peak() -> int:
        return torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")

    def reset_peak() -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    baseline = held()  # everything imported, the process group joined, no model
    host_baseline = _status_bytes("VmRSS")
    cfg = TrainerConfig(
        zero_stage=setup.zero_stage,
        dtype=setup.dtype,
        lr=1e-5,
        micro_batch_size=setup.micro_batch,
        logits_chunk_tokens=setup.logits_chunk_tokens,
        gradient_checkpointing=setup.gradient_checkpointing,
        zero_bucket_elements=setup.bucket_elements,
        **trainer_extras(setup, out.parent),
    )
    started = time.perf_counter()
    trainer = PolicyTrainer(model_dir, cfg)
    load_peak = peak() - baseline
    load_host_peak = _status_bytes("VmHWM") - host_baseline
    built = held() - baseline
    groups = _groups(setup, trainer.hf_config.vocab_size, setup.ranks)
    reset_peak()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(groups)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    result = {
        "rank": trainer.dp.rank,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "baseline_bytes": baseline,
        "load_peak_bytes": load_peak,
        "load_host_peak_bytes": load_host_peak,
        "built_bytes": built,
        "train_peak_bytes": peak() - baseline,
        "train_host_peak_bytes": _status_bytes("VmHWM") - host_baseline,
        "end_bytes": held() - baseline,
        "step_seconds": [round(s, 3) for s in seconds],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out.write_text(json.dumps(result))


def measure(
    shape: ModelShape, setup: LearnerSetup, steps: int = 2, model_dir: Path | None = None, device: str = "cpu"
) -> dict:
    """Run ``setup.ranks`` ranks on a model of ``shape`` and return measured against predicted.

    ``device`` "cuda": one GPU per rank, the peak is ``torch.cuda.max_memory_allocated`` over the
    allocated bytes before the model, against the prediction's device components alone."""
    from asyncrl.fleet.launcher import learner_rank_env
    from asyncrl.wire.endpoints import free_ports

    setup = as_trained(setup)
    with tempfile.TemporaryDirectory(prefix="memory_measure_") as tmp:
        tmp = Path(tmp)
        model_dir = model_dir or build_model(shape, tmp / "model")
        argv = [
            sys.executable,
            "-m",
            "asyncrl.benchmarks.memory_measure",
            str(model_dir),
            json.dumps(asdict(setup)),
            str(steps),
            str(tmp),
        ]
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
        if device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
            env["CUDA_VISIBLE_DEVICES"] = ""
        procs = [
            subprocess.Popen(argv, env={**env, **rank_env}, cwd=root)
            for rank_env in learner_rank_env(setup.ranks, free_ports(1)[0])
        ]
        try:
            codes = [p.wait(timeout=RANK_TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes != [0] * setup.ranks:
            raise RuntimeError(f"{shape.name} {setup}: rank exit codes {codes}")
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(setup.ranks)]
    est = predict(shape, setup)
    # one memory on the CPU: the device's and the host's components together
    predicted_train = (
        phase_peak({**est.device, **est.host}, setup.zero_stage, setup.micro_batches)
        if device == "cpu"
        else est.device_train
    )
    measured_train = max(r["train_peak_bytes"] for r in ranks)
    return {
        "shape": shape.name,
        "parameters": shape.parameters(),
        "setup": asdict(setup),
        "steps": steps,
        "device": ranks[0]["device"],
        "predicted": est.to_dict(),
        "predicted_train_bytes": round(predicted_train),
        "predicted_load_bytes": round(est.load_host),
        "measured_train_bytes": measured_train,
        "measured_load_bytes": max(r["load_peak_bytes"] for r in ranks),
        "train_ratio": measured_train / predicted_train,
        "ranks": ranks,
    }


def quick_setup(**overrides) -> LearnerSetup:
    """The measurement's defaults: fp32 (bf16 is emulated on many CPUs), a small bucket so that
    the buffer is the same size on every backend (DeepSpeed's 5e8 elements are mostly untouched
    pages on the CPU)."""
    base = LearnerSetup(dtype="fp32", seq_len=256, micro_batch=4, scored_fraction=0.75, bucket_elements=1 << 22)
    return replace(base, **overrides)


if __name__ == "__main__":
    model_dir, setup_json, steps, out_dir = sys.argv[1:5]
    setup = LearnerSetup(**json.loads(setup_json))
    rank_main(Path(model_dir), setup, int(steps), Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.json")


def repredict(run: dict) -> dict:
    """``run`` (an entry of ``memory_measured.json``) with its prediction redone by the model as
    it is now; the measured figures stay as they were."""
    from asyncrl.benchmarks.model_shapes import shape as named_shape

    setup = LearnerSetup(**run["setup"])
    est = predict(named_shape(run["shape"]), setup)
    cpu = run.get("device", "cpu") == "cpu"
    predicted = (
        phase_peak({**est.device, **est.host}, setup.zero_stage, setup.micro_batches) if cpu else est.device_train
    )
    return {
        **run,
        # the prediction written when the run was measured, kept once: where it equals the one
        # below, the model predicted this run before it was measured
        "predicted_at_measurement_bytes": run.get("predicted_at_measurement_bytes", run["predicted_train_bytes"]),
        "predicted": est.to_dict(),
        "predicted_train_bytes": round(predicted),
        "train_ratio": run["measured_train_bytes"] / predicted,
    }


def offloaded(setup: dict) -> str:
    """What a run offloads, for its ZeRO cell: "" when nothing.

    >>> offloaded({"optimizer_offload": "nvme", "param_offload": "nvme"})
    ', optimizer and parameters on nvme'
    >>> offloaded({"optimizer_offload": "cpu"})
    ', optimizer on cpu'
    """
    opt, par = setup.get("optimizer_offload", "none"), setup.get("param_offload", "none")
    if opt == par == "none":
        return ""
    if opt == par:
        return f", optimizer and parameters on {opt}"
    parts = [f"optimizer on {opt}"] * (opt != "none") + [f"parameters on {par}"] * (par != "none")
    return ", " + ", ".join(parts)


def measured_markdown(runs: list[dict]) -> str:
    """The measured runs as a markdown table: predicted and measured training peaks per rank."""
    mib = 1 << 20
    lines = [
        "| shape | parameters | ZeRO | ranks | dtype | tokens per rank | predicted MiB | measured MiB (max over ranks) | measured / predicted | predicted before measured | load peak MiB | step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        s = r["setup"]
        steps = [t for rank in r["ranks"][:1] for t in rank["step_seconds"]]
        lines.append(
            f"| {r['shape']} | {r['parameters'] / 1e6:,.0f} M | {s['zero_stage']}{offloaded(s)} | {s['ranks']} | {s['dtype']} "
            f"| {s['micro_batch']} × {s['seq_len']}{', checkpointed' if s['gradient_checkpointing'] else ''} "
            f"| {r['predicted_train_bytes'] / mib:,.0f} "
            f"| {r['measured_train_bytes'] / mib:,.0f} | **{r['train_ratio']:.3f}** "
            f"| {'yes' if abs(r.get('predicted_at_measurement_bytes', 0) - r['predicted_train_bytes']) < mib else 'no'} "
            f"| {r['measured_load_bytes'] / mib:,.0f} | {' / '.join(f'{t:.1f}' for t in steps)} |"
        )
    return "\n".join(lines)
