"""Time to publish the learner's weights, as a function of their bytes: fitted here, extrapolated.

A publication is three stages in turn (``asyncrl.weights``; the learner's ``broadcast`` and the
generator's ``version`` events time them in a run, ``asyncrl.weights.timeline``):

1. **gather**: under ZeRO-3 each bucket's all-gather leaves the whole bucket on the ranks; a
   ring all-gather moves (N-1)/N of the bytes through each rank's link;
2. **transport** to the generators: NCCL from device to device, or out through the host
   (device-to-host copy, then shared memory on one host or the ZeroMQ stream across hosts);
3. **reload** into the engine (vLLM's ``load_weights``: from host tensors a host-to-device copy).

Each stage is t = t0 + bytes / rate. Here (``fit``) the rates are least-squares fits to the
figures in ``bench/results``: the ZeroMQ stream and shared memory to one subscriber
(``weights.json``, 100 MB to 1 GB), the ZeRO-3 gather of two CPU ranks over gloo
(``learner_ranks.json``), vLLM's CPU reload of full weights (``lora_sync.json``: 0.54 and 1.98 GB
on an AVX2 host; ``rehearsal.json``: 1.98 GB on an AVX-512 host).
For 7 B and 32 B on GPUs (``extrapolate``) the rates are the links' (``LINKS``): stated, not
measured here, except the device-host copies and the ZeroMQ loopback rate, measured on an H200
host. The CPU fit says what the stages cost per byte where the code ran; what a GPU
node will do is the link arithmetic, and is marked so.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.benchmarks.model_shapes import SHAPES

GB = 1e9
LINKS = {
    # rate in bytes/s, where it comes from
    "nvlink_allgather": (
        360 * GB,
        "NCCL all-gather bus bandwidth, 8 x H100/H200 SXM (NVLink 4, 900 GB/s per GPU), typical nccl-tests",
    ),
    "ib_allgather": (45 * GB, "NCCL over InfiniBand NDR 400 Gb/s, one HCA per GPU"),
    "nvlink_broadcast": (360 * GB, "NCCL broadcast over NVLink 4 within a node"),
    "ib_broadcast": (45 * GB, "NCCL broadcast over InfiniBand NDR 400 Gb/s"),
    "d2h_pinned": (55 * GB, "device-to-host, pinned, measured on an H200 host"),
    "h2d_pageable": (15 * GB, "host-to-device, pageable, measured on an H200 host"),
    "zmq_tcp": (1.7 * GB, "one ZeroMQ stream, 64 MiB frames, 1.5-1.9 GB/s on an H200 host"),
    "pcie5_nic_tcp": (12.5 * GB, "100 GbE host TCP, line rate (a single stream reaches ~zmq_tcp)"),
    "d2d_copy": (1000 * GB, "a copy within HBM3 (3.3-4.8 TB/s read + write): vLLM's load_weights from device tensors"),
}
PATHS = {
    # the stages of each way to publish from a learner on one node of 8 GPUs:
    # (gather link, [transport links], reload link)
    "nccl, generators on the same node": ("nvlink_allgather", ["nvlink_broadcast"], "d2d_copy"),
    "nccl, generators on another node": ("nvlink_allgather", ["ib_broadcast"], "d2d_copy"),
    "nccl, learner on 4 nodes (32 ranks: ZeRO-3 gather over InfiniBand)": (
        "ib_allgather",
        ["ib_broadcast"],
        "d2d_copy",
    ),
    "shared memory, same host (rate measured here)": ("nvlink_allgather", ["d2h_pinned", "shm_here"], "h2d_pageable"),
    "zmq stream, another host": ("nvlink_allgather", ["d2h_pinned", "zmq_tcp"], "h2d_pageable"),
}


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = t0 + bytes / rate over (bytes, seconds); (t0, rate). One point: t0 = 0."""
    if len(points) == 1:
        b, t = points[0]
        return 0.0, b / t
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    slope = sum((b - mx) * (t - my) for b, t in points) / sum((b - mx) ** 2 for b, _ in points)
    return max(0.0, my - slope * mx), 1.0 / slope


def fit(results: Path) -> dict:
    """Per-stage (t0 s, rate B/s) fitted to the figures measured here (module docstring)."""
    weights = json.loads((results / "weights.json").read_text())
    one = [c for c in weights["cases"] if c["subscribers"] == 1]
    out = {}
    for key in ("shm_s", "zmq_s"):
        t0, rate = linear_fit([(c["size_mb"] * 1e6, c[key]) for c in one])
        out[key[:-2] + "_here"] = {"t0_s": t0, "rate_Bps": rate, "points": len(one), "source": "weights.json"}
    ranks = json.loads((results / "learner_ranks.json").read_text())
    pub = ranks["stages"]["zero3"]["publication"]
    nbytes = sum(pub["bytes_packed_per_rank"]["rank0_publishes"])
    t0, rate = linear_fit([(nbytes / 2, pub["rank0_publishes_s"])])  # two ranks: half the bytes cross
    out["gather_here"] = {"t0_s": t0, "rate_Bps": rate, "points": 1, "source": "learner_ranks.json (gloo, 2 ranks)"}
    sync = json.loads((results / "lora_sync.json").read_text())
    points = [(m["full"]["bytes_per_version"], m["full"]["stages_median_s"]["reload_s"]) for m in sync["models"]]
    t0, rate = linear_fit(points)
    out["reload_here"] = {
        "t0_s": t0,
        "rate_Bps": rate,
        "points": len(points),
        "source": "lora_sync.json (vLLM CPU, AVX2 host)",
    }
    rehearsal = json.loads((results / "rehearsal.json").read_text())["publication_to_served_stages_mean_s"]
    t0, rate = linear_fit([(4 * SHAPES["qwen2.5-0.5b"].parameters(), rehearsal["reload_s"])])
    out["reload_here_avx512"] = {
        "t0_s": t0,
        "rate_Bps": rate,
        "points": 1,
        "source": "rehearsal.json (vLLM CPU, AVX-512 host)",
    }
    return out


def stage_seconds(nbytes: float, t0: float, rate: float) -> float:
    return t0 + nbytes / rate


def extrapolate(calibrated: dict, ranks: int = 8) -> dict:
    """Seconds per stage and in all, for 7 B and 32 B in bf16, on each path of ``PATHS``."""
    rates = {k: v[0] for k, v in LINKS.items()}
    rates["shm_here"] = calibrated["shm_here"]["rate_Bps"]
    out = {}
    for name in ("qwen2.5-7b", "qwen2.5-32b"):
        nbytes = 2 * SHAPES[name].parameters()
        model = {"bytes": nbytes}
        for path, (gather, transport, reload) in PATHS.items():
            n = 4 * ranks if gather == "ib_allgather" else ranks
            stages = {"gather_s": nbytes * (n - 1) / n / rates[gather]}
            for link in transport:
                stages[f"{link}_s"] = nbytes / rates[link]
            stages["reload_s"] = nbytes / rates[reload]
            model[path] = {**{k: round(v, 2) for k, v in stages.items()}, "total_s": round(sum(stages.values()), 2)}
        out[name] = model
    return out


def publication_report(results: Path) -> dict:
    """The fit here, what it predicts for the rehearsal's 0.5 B publication, and the extrapolation."""
    calibrated = fit(results)
    rehearsal = json.loads((results / "rehearsal.json").read_text())
    nbytes = 4 * SHAPES["qwen2.5-0.5b"].parameters()
    here = {
        "bytes": nbytes,
        "predicted_transport_out_s": stage_seconds(
            nbytes, calibrated["shm_here"]["t0_s"], calibrated["shm_here"]["rate_Bps"]
        ),
        "measured_transport_out_s": rehearsal["publication_to_served_stages_mean_s"]["transport_out_s"],
        "predicted_reload_s": stage_seconds(
            nbytes, calibrated["reload_here"]["t0_s"], calibrated["reload_here"]["rate_Bps"]
        ),
        "measured_reload_s": rehearsal["publication_to_served_stages_mean_s"]["reload_s"],
        "note": (
            "rehearsal.json: the 0.5 B shape in fp32, one rank (no gather), shared memory, on an AVX-512 "
            "host of this kind; the reload fit is lora_sync.json's, on an AVX2 host, where vLLM's CPU "
            "backend repacks the weights ~4.8x slower: the reload is the host's, not the bytes'"
        ),
    }
    return {
        "calibrated_here": calibrated,
        "check_rehearsal_0_5b": here,
        "links": {k: {"rate_GBps": v[0] / GB, "source": v[1]} for k, v in LINKS.items()},
        "extrapolated_bf16_8_ranks": extrapolate(calibrated),
        "note": "extrapolated figures are link arithmetic (LINKS), not measurements; the CPU fit is from bench/results",
    }
