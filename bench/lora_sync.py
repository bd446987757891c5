"""Benchmark: adapter-only weight sync against full weights, bytes and seconds per published version.

    OMP_NUM_THREADS=1 flock /tmp/asyncrl-heavy.lock .venv/bin/python bench/lora_sync.py
    .venv/bin/python bench/lora_sync.py --models smollm2 --versions 3     # the real model only

For each model, the real SmolLM2-135M-Instruct (``asyncrl model fetch smollm2-135m-instruct``,
float32 as its recipe runs it) and the Qwen2.5-0.5B shape (``configs/rehearsal_0_5b.yaml``'s
``model.tiny``, random weights; float32 by default, ``--dtype-0-5b bfloat16`` as that recipe's
engine, which halves both paths' bytes and is emulated, slowly, on a CPU without native
bfloat16), three ways of serving a new version, each through the run's own pieces, in one process:

- ``full``: the learner publishes every weight (``iter_buckets`` of the model, its dtype) over
  shared memory; the generator's vLLM engine (no LoRA) reloads them (``reload_weights``);
- ``adapter``: the learner is a peft model (rank ``--rank`` on q, k, v, o, gate, up, down) and
  publishes only the adapter (``get_peft_model_state_dict``, the model's dtype) with
  ``meta["adapter"]``; the engine (``enable_lora``) loads it as a new LoRA adapter
  (``asyncrl.generators.engines.lora``);
- ``merge``: the same adapter published, merged on the generator side (base + B·A·alpha/r, the
  base read from the model folder) and only the targeted matrices reloaded, into an engine
  without LoRA (``engine.lora_serving: merge``).

Each version: the learner's step is simulated (every weight, or every lora_B, moved by noise),
then publication -> served as a run times it (``asyncrl.weights.timeline``: the learner's
``broadcast`` and the generator's ``version`` event joined; probe, gather, transport, reload,
probe check), the generator applying it with ``apply_newest_weights`` and the calibrated probe
(so each version is proven served; the adapter's probe also proves that the base is not). Here
the learner and the generator take turns on the same cores, so ``total_s`` is the sum of both
sides' work. Per path: ``bytes`` per version, ``total_s`` per version (the first includes the
probe's calibration) and their median, the stages' medians, and the engine's sampling rate
(``decode_tokens_per_s``: ``--prompts`` prompts x 4 answers of ``--tokens`` tokens) on what it
serves, since LoRA kernels cost at every step, not only at a swap. Ratios: ``adapter_bytes_ratio``
(goal <= 0.05), ``adapter_vs_full_s`` (goal < 1). One JSON object on stdout, also written to
bench/results/lora_sync.json.
"""

from __future__ import annotations

import os

for _k, _v in {
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402
from asyncrl.generators.weights_apply import apply_newest_weights  # noqa: E402
from asyncrl.weights.buckets import iter_buckets, state_dict_buckets  # noqa: E402
from asyncrl.weights.probe import Probe, ProbeCheck, learner_probe, probe_tolerance  # noqa: E402
from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber  # noqa: E402
from asyncrl.weights.timeline import STAGES, PublicationTimeline, TimedBuckets  # noqa: E402
from asyncrl.wire.messages import BroadcastEvent  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUCKET_BYTES = 64 << 20  # weights.bucket_mb's default
OUT = REPO / "bench" / "results" / "lora_sync.json"


class Events:
    """The generator's reports (``version`` events), kept."""

    def __init__(self):
        self.events = []

    def emit(self, event):
        self.events.append(event)


def model_dirs(names: list[str], root: Path, dtype_0_5b: str) -> dict[str, tuple[Path, str]]:
    """name -> (model folder, engine and learner dtype)."""
    out = {}
    if "smollm2" in names:
        from asyncrl.models.fetch import fetch_model

        out["smollm2-135m-instruct"] = (fetch_model("smollm2-135m-instruct", "float32"), "float32")
    if "qwen2_0_5b" in names:
        import yaml

        from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

        shape = yaml.safe_load((REPO / "configs" / "rehearsal_0_5b.yaml").read_text())["model"]["tiny"]
        folder = root / "qwen2_0_5b_shape"
        if not (folder / "config.json").exists():
            build_tiny_model(TinyModelConfig(**shape), folder)
        out["qwen2.5-0.5b-shape"] = (folder, dtype_0_5b)
    return out


def learner_model(model_dir: Path, dtype: str, rank: int | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    if rank is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def train_step(model, seed: int, adapter: bool) -> None:
    """Stand-in for an optimizer step: every trainable weight (the lora_B of an adapter, else
    every weight) moved by noise, so that consecutive versions differ on the probe text."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if adapter and "lora_B" not in name:
                continue
            scale = 0.02 if adapter else 1e-3 * float(p.float().std().clamp(min=1e-3))
            p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.dtype))


def engine_for(model_dir: Path, dtype: str, serving: str | None, rank: int, max_model_len: int):
    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    cfg = EngineConfig(
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=128 << 20,
        seed=0,
        lora_serving=serving or "adapter",
    )
    start = time.perf_counter()
    engine = VLLMEngine(str(model_dir), cfg, lora_rank=None if serving is None else rank)
    return engine, time.perf_counter() - start


def decode_rate(engine, prompts: int, tokens: int) -> float:
    """Tokens per second sampling ``prompts`` prompts x 4 answers of ``tokens`` tokens."""
    from asyncrl.generators.sampling import SamplingConfig, sampling_params

    batch = [f"{a}+{b}=" for a, b in zip(range(11, 11 + prompts), range(40, 40 + prompts))]
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=tokens)
    params = sampling_params(sampling, len(batch), list(range(len(batch))), ignore_eos=True)  # every answer full length
    start = time.perf_counter()
    out = engine._llm.generate(
        engine.tokenize_prompts(batch), params, use_tqdm=False, lora_request=engine.lora_request()
    )
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for o in out for c in o.outputs) / seconds


def publish_versions(path: str, engine, model, tok, dtype: str, versions: int, rank: int) -> dict:
    """Publish ``versions`` versions over shm and have the engine serve each (see the module docstring)."""
    from peft import get_peft_model_state_dict

    adapter = path != "full"
    meta_adapter = {"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "base_version": 0}
    max_len = engine.cfg.max_model_len
    pub = ShmWeightPublisher("tcp://127.0.0.1:0")
    sub = ShmWeightSubscriber(pub.address, name="gen-0.weights")
    check = ProbeCheck(atol=probe_tolerance(dtype, "fp32" if dtype == "float32" else "bf16"))
    timeline, ctx = PublicationTimeline(), Events()
    last = Probe(**learner_probe(model, tok, max_len=max_len), version=engine.version)
    rows = []
    try:
        for step in range(1, versions + 1):
            version = engine.version + 1
            train_step(model, seed=step, adapter=adapter)
            published_at = time.time()
            body = learner_probe(model, tok, max_len=max_len)
            last = last.after(version, body["logprobs"], body.get("base_logprobs"))
            probe_s = time.time() - published_at
            if adapter:
                state = get_peft_model_state_dict(model)
                buckets = TimedBuckets(state_dict_buckets(state, BUCKET_BYTES))
                meta = {"probe": last.to_wire(), "adapter": meta_adapter}
            else:
                buckets = TimedBuckets(iter_buckets(model, BUCKET_BYTES))
                meta = {"probe": last.to_wire()}
            stats = pub.publish(buckets, version, meta=meta)
            timeline.on_broadcast(
                BroadcastEvent(
                    version=version,
                    transport=pub.transport,
                    published_at=published_at,
                    gather_s=buckets.seconds,
                    probe_s=probe_s,
                    bytes=stats["bytes"],
                    buckets=stats["buckets"],
                    seconds=stats["seconds"],
                )
            )
            deadline = time.monotonic() + 600
            while engine.version != version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path}: version {version} was not served within 600 s")
                apply_newest_weights(engine, sub, ctx, probe=check)
                pub.announce()
            (record,) = timeline.on_served(ctx.events[-1])
            probe = ctx.events[-1].probe
            rows.append(
                {
                    "version": version,
                    "bytes": stats["bytes"],
                    **{k: round(v, 4) for k, v in record.items() if k.endswith("_s")},
                    "probe_mean_diff": probe.mean_diff,
                    "probe_tol": probe.tol,
                    "probe_base_separation": probe.base_separation,
                    "probe_base_diff": probe.base_diff,
                }
            )
    finally:
        pub.close()
        sub.close()
    later = rows[1:] or rows  # the first version also calibrates the probe
    return {
        "bytes_per_version": rows[-1]["bytes"],
        "total_s_median": statistics.median(r["total_s"] for r in later),
        "stages_median_s": {s: round(statistics.median(r[s] for r in later), 4) for s in STAGES if s in later[0]},
        "versions": rows,
    }


PATHS = {"full": None, "merge": "merge", "adapter": "adapter"}
"""Path -> ``engine.lora_serving`` (None: an engine without LoRA, full weights)."""


def bench_model(name: str, model_dir: Path, dtype: str, args) -> dict:
    result = {"model": name, "path": str(model_dir), "dtype": dtype, "rank": args.rank}
    result["engine_start_s"], result["decode_tokens_per_s"] = {}, {}
    for path, serving in PATHS.items():
        engine, start_s = engine_for(model_dir, dtype, serving, args.rank, args.max_model_len)
        result["engine_start_s"][path] = round(start_s, 2)
        try:
            model, tok = learner_model(model_dir, dtype, None if serving is None else args.rank)
            if serving is None:
                result["parameters"] = sum(p.numel() for p in model.parameters())
            else:
                result["adapter_parameters"] = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
            result[path] = publish_versions(path, engine, model, tok, dtype, args.versions, args.rank)
            # Sampling with what it serves now (LoRA kernels run at every step of an adapter).
            result["decode_tokens_per_s"][path] = round(decode_rate(engine, args.prompts, args.tokens), 1)
            if engine.adapters is not None:
                result["adapters_live_after"] = [a.name for a in engine.adapters.live]
                result["adapter_names_used"] = list(engine.adapters.used_names)
            del model
        finally:
            engine.close()
            del engine
            gc.collect()
    full, adapter, merge = result["full"], result["adapter"], result["merge"]
    result["adapter_bytes_ratio"] = round(adapter["bytes_per_version"] / full["bytes_per_version"], 5)
    result["adapter_vs_full_s"] = round(adapter["total_s_median"] / full["total_s_median"], 4)
    result["merge_vs_full_s"] = round(merge["total_s_median"] / full["total_s_median"], 4)
    result["adapter_vs_merge_s"] = round(adapter["total_s_median"] / merge["total_s_median"], 4)
    result["adapter_decode_vs_merge"] = round(
        result["decode_tokens_per_s"]["adapter"] / result["decode_tokens_per_s"]["merge"], 4
    )
    result["goals_met"] = {
        "bytes_at_most_5_percent": result["adapter_bytes_ratio"] <= 0.05,
        "served_faster": result["adapter_vs_full_s"] < 1.0,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen2_0_5b"], choices=["smollm2", "qwen2_0_5b"])
    parser.add_argument("--versions", type=int, default=4, help="versions published per path (the first calibrates)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4, help="prompts (x 4 answers) of the decode-rate check")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer of the decode-rate check")
    parser.add_argument(
        "--root", type=Path, default=Path("/tmp/asyncrl-bench-lora"), help="where the 0.5 B shape is built"
    )
    parser.add_argument(
        "--dtype-0-5b",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the 0.5 B shape's dtype (its recipe's engine runs bfloat16, emulated where the CPU lacks it)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    start = time.time()
    results = {
        "benchmark": "lora_sync",
        "commit": measured_commit(),
        "host": f"{os.cpu_count()} CPUs (this machine), torch threads {torch.get_num_threads()}",
        "transport": "shm",
        "targets": TARGETS,
        "models": [],
    }
    for name, (model_dir, dtype) in model_dirs(args.models, args.root, args.dtype_0_5b).items():
        results["models"].append(bench_model(name, model_dir, dtype, args))
        print(json.dumps(results["models"][-1]), file=sys.stderr, flush=True)
    results["wall_s"] = round(time.time() - start, 1)
    results["load_average"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
