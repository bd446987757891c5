"""Config of weight sync: how (transport), in what dtype, how big (buckets), when (schedule), checked how (probe)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config


class WeightSyncConfig(Config):
    """How the learner's weights reach the generators (the run's ``weights`` section)."""

    transport: Literal["file", "shm", "zmq", "nccl"] = "shm"
    """``shm``: buckets written once into /dev/shm, mapped by every generator on this host;
    ``zmq``: streamed in ~1 MiB frames to subscribers on any host; ``nccl``: broadcast from GPU
    to GPU in an NCCL group of learner rank 0 and every generator (needs CUDA); ``file``: one
    safetensors file per version in RUN_DIR/weights (the original path, a whole-model copy in the learner)."""
    apply_mode: Literal["between_requests", "in_flight"] | None = None
    """``between_requests``: a generator swaps weights between engine calls, so one version samples
    every token of a request; ``in_flight``: it samples through vLLM's AsyncLLM and swaps while
    requests run (pause keeping them, reload, reset the prefix cache, resume), each sample then
    recording which versions sampled which tokens (``version_segments``). None: ``in_flight``
    with ``generator.mode: continuous`` (the only mode it allows: requests never stop running),
    ``between_requests`` with ``batch``."""
    dtype: Literal["model", "bfloat16", "float16"] = "model"
    """The dtype floating-point weights are published in. ``model``: as the learner holds them (an
    fp32 learner sends 4 bytes a parameter). ``bfloat16`` / ``float16``: cast on the learner,
    bucket by bucket, before they leave: half the bytes on the wire, in shared memory and in the
    generator's buffers, for an engine that serves that dtype anyway (vLLM casts on loading, to
    the same values); it must then be the engine's ``engine.dtype``."""
    bucket_mb: float = Field(64.0, gt=0)
    """Size cap of one bucket in MiB: under ZeRO-3 the learner gathers, sends and frees one
    bucket at a time, so its extra memory is about two buckets, not the model."""
    checksum: Literal["fletcher64", "xxh3", "sum64", "crc32"] = "sum64"
    """Per-bucket checksum checked on arrival: Fletcher-64, xxh3 or a 64-bit word sum (all memory
    speed), or CRC-32 (~2 GB/s); see ``asyncrl.weights.buckets.HASHES``. Left unset,
    ``fletcher64`` with the zmq transport (order-sensitive, summed frame by frame in the pass
    that copies each frame to its place) and ``sum64`` with the others (shm sums tensors apart
    on a second thread, nccl on the GPU: both need a sum's additivity)."""
    frame_mb: float = Field(1.0, gt=0)
    """Size of one ZeroMQ frame in MiB (zmq transport)."""
    schedule: Literal["every_k", "every_s", "staleness"] = "every_k"
    """When to publish: every ``learner.broadcast_every`` steps; every ``every_s`` seconds (after
    the first step past it); or only when needed to keep samples within the staleness bound
    (see ``BroadcastSchedule``). The last step is always published."""
    every_s: float = Field(10.0, gt=0)
    """Seconds between publications of the ``every_s`` schedule."""
    staleness_margin: int = Field(1, ge=0)
    """``staleness`` schedule: publish when the generators' version would be this many steps
    short of falling outside ``buffer.max_staleness`` (room for samples still in flight)."""
    probe: bool = True
    """After applying a version, the generator scores a fixed text (dozens of tokens) and compares
    with the learner's logprobs sent along; a mismatch beyond numerics is an error
    (``asyncrl.weights.probe``)."""
    probe_atol: float | None = Field(None, gt=0)
    """Bound on the probe's mean |logprob difference| until it is calibrated, and a tenth of the
    most a calibration may measure; None derives it from the engine's and the trainer's dtypes
    (``asyncrl.weights.probe.probe_tolerance``: 1e-3 when both are float32; 2e-2 with float16;
    0.15 with bfloat16 or an engine dtype of auto)."""
    probe_noise_factor: float = Field(5.0, ge=1)
    """Once calibrated (at the first update, on the weights both sides share), the probe's bound is
    this many times the mean mismatch measured there: the bound scales with the model's numerics."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds a generator waits for the next message of a version being streamed, and the
    learner for a bucket to leave for every subscriber; past it the wait is reported by name."""
    keep_s: float = Field(60.0, gt=0)
    """shm: seconds a superseded version stays in shared memory when not every generator acked it."""
    poll_s: float = Field(0.05, gt=0)
    """in_flight: seconds between a generator's checks for a newly announced version."""

    @model_validator(mode="before")
    @classmethod
    def default_checksum(cls, data):
        if isinstance(data, dict) and "checksum" not in data and data.get("transport") == "zmq":
            data = {**data, "checksum": "fletcher64"}
        return data

    @model_validator(mode="after")
    def check_nccl(self) -> WeightSyncConfig:
        if self.transport == "nccl":
            if self.checksum != "sum64":
                raise ValueError(
                    f"weights.checksum ({self.checksum}) must be sum64 with weights.transport nccl: it is computed on the GPU"
                )
            import torch  # only here: reading any other config stays free of torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "weights.transport (nccl) needs CUDA, and torch sees no CUDA device here: use shm (same host) or zmq"
                )
        return self
