"""Predicted peak memory of one learner rank: device and host, component by component.

``predict(shape, setup)`` adds up what a DeepSpeed ZeRO rank of ``PolicyTrainer`` holds, for a
model shape (``asyncrl.benchmarks.model_shapes``) and a ``LearnerSetup`` (ranks, ZeRO stage,
precision, offload, sequence parallelism, sequence length, micro batch). Ψ is the parameter
count, N the ranks that ZeRO partitions over, b the bytes of a parameter in the training dtype
(2 for bf16, 4 for fp32). The model states follow Rajbhandari et al. 2020 ("ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", §3.1 and Figure 1: bΨ of parameters,
bΨ of gradients and KΨ of AdamW state, K = 12 with an fp32 master, each term divided by N from the
stage that partitions it), with DeepSpeed 0.19's own buffers beside them:

- parameters: bΨ (ZeRO-0/1/2); bΨ/N at ZeRO-3, plus the tensors under the persistence threshold
  (norms, biases) whole, plus the gathered ones in the backward (the larger of one block and the
  embedding, the prefetch bucket, and the last ``max_reuse_distance``/2 elements of blocks, which
  DeepSpeed keeps gathered from their forward to their backward; at most ``max_live_parameters``;
  none on one rank);
- gradients: bΨ at ZeRO-0/1 (and a 4Ψ fp32 accumulator in DeepSpeed's bf16 optimizer at ZeRO-0;
  and at ZeRO-0 in fp32 their flattened copy, up to 5e8 elements, which the engine all-reduces at
  the boundary, one rank included),
  bΨ/N at ZeRO-2/3 plus the reduce bucket (``zero_bucket_elements``, two of them where DeepSpeed
  overlaps communication: ZeRO-3 by default);
- optimizer: AdamW's two fp32 moments 8Ψ/N (8Ψ at ZeRO-0 fp32, where the torch optimizer is
  not partitioned), the fp32 master 4Ψ/N (under bf16, and under fp32 at ZeRO-1/2/3 too: DeepSpeed
  clones one even when the weights are fp32; ``fp32_master_when_fp32`` = False is the change that
  drops it), and the step's fp32 gradient partition: 4Ψ/N at ZeRO-1/2 (plus, under bf16, the
  flattened bf16 partition it is cast from, bΨ/N), one ``sub_group_size`` at a time at ZeRO-3.

The training peak is what stays allocated through the step (parameters, optimizer state, buckets,
ZeRO-3's gradient partition) plus the larger of what the start of the backward holds
(activations, logits, ZeRO-3's gathered parameters) and what its end and the step hold (ZeRO-0/1/2's
gradients, which the backward fills as it frees the activations and the step frees, ZeRO-0's
flattened all-reduce copy of them, and the fp32 gradient partition), as ``phase_peak`` adds them; with several micro batches per update the
gradients are there under every backward after the first.

Activations are counted per token and per block from the tensors autograd keeps for the backward,
as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
§4.1, eq. 1: sbh(34 + 5as/h) bytes per layer) count them, redone for this family of block: RMSNorm
instead of LayerNorm, no dropout, grouped-query attention (Hugging Face's eager and sdpa paths
repeat k and v to every head, flash-attention does not), a SwiGLU MLP of width f instead of 4h:

- each RMSNorm keeps its input, its normalised input and its output (3bh), plus the input cast to
  fp32 (4h) when b < 4;
- attention keeps q (bh), k and v (2b·h repeated, 2b·kv_width with flash-attention), its output and
  o_proj's contiguous input (2bh) and the softmax statistics (4a); eager attention also keeps the
  probabilities, fp32 and cast (a·s·(4 + b) per token: the quadratic term, Korthikanti's 5as/h);
- the MLP keeps gate, silu(gate), up and their product (4bf).

With gradient checkpointing a block keeps only its input (bh per token) and one block's
activations are rebuilt at a time in the backward. The peak is at the start of the backward: the
gradients of a block's saved tensors, made as its backward runs, are fewer bytes than the saved
tensors it frees (measured here: the peak grows by ~0.95 of these bytes per added token).

The logits (``asyncrl.learner.logprobs``) are ``logits_chunk_tokens`` positions × V at a time: the
chunk's logits in the model dtype, then in fp32, the softmax and the gradient, ``LOGIT_BUFFERS``
fp32 (n, V) buffers in all at the backward's recomputation (measured here: 4.0 buffers over a
chunk's forward and backward at V = 151,936). Sequence parallelism (DeepSpeed Ulysses, ``sequence_parallel`` = P)
divides each rank's activations by P (its all-to-all gives a rank s/P tokens of every head, or s
tokens of a/P heads: the same bytes); ZeRO still partitions over all N ranks.

Offload moves the optimizer state (master, moments, fp32 gradients) and, at ZeRO-3, the parameter
partitions from the device to the host (``cpu``) or to NVMe (``nvme``: the host then holds the swap
buffers and, for the optimizer, the ``sub_group_size`` elements being updated: 16 bytes each).
At ZeRO-3 two buffers stay in host memory whatever the offload's target (DeepSpeed 0.19.8's
``stage3.py``): with the optimizer offloaded, the flat partition every gradient is reduced into
(bΨ/N, on the optimizer's device); with the parameters on NVMe, a flat host copy of up to
``offload_param.max_in_cpu`` elements of the partition (1e9 by default: all of it below a
billion elements per rank, so that NVMe then saves host memory only where the limit is lowered).
The host also holds, at start-up, the fp32 model each rank loads whole (``PolicyTrainer``:
``from_pretrained`` in fp32), and the device the whole model in the training dtype before ZeRO-3
partitions it, unless ``partitioned_load`` (``zero.Init``, ZeRO-3 only): then
a rank holds its share plus one block.

Where this differs from a peer's estimate: DeepSpeed's ``estimate_zero3_model_states_mem_needs``
counts model states only (no activations, logits or buckets); this adds the buffers DeepSpeed
allocates and the transients of the step, which is what the measurements here (``bench/memory.py
measure``) check.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from asyncrl.benchmarks.model_shapes import ModelShape

DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's reduce_bucket_size and allgather_bucket_size when the config leaves them out."""
DEEPSPEED_ALLREDUCE_ELEMENTS = 500_000_000
"""Without ZeRO DeepSpeed's engine flattens the gradients into buffers of this many elements to
all-reduce them at the accumulation boundary, on one rank too (``MEMORY_OPT_ALLREDUCE_SIZE``)."""
LOGIT_BUFFERS = 4
"""fp32 (chunk, V) buffers alive at the backward's recomputation of a logits chunk: the logits,
the softmax, the gradient and the gathered target's scatter (see the module docstring)."""
GiB = 1 << 30
BACKWARD_ONLY = ("activations", "logits", "parameters_gathered")
"""Alive in the forward and backward only: full at the start of the backward, freed as it goes."""
AFTER_BACKWARD = ("gradients", "gradients_fp32_accumulator", "allreduce_buffer", "fp32_gradient_partition")
"""ZeRO-0/1/2's gradients (filled as the backward frees the activations, freed after the step)
and the step's fp32 gradient partition; ZeRO-3's gradient partition stays allocated."""


def phase_peak(parts: dict[str, float], zero_stage: int = 0, micro_batches: int = 1) -> float:
    """What stays allocated through the step, plus the larger of the start of the backward
    (activations, logits, gathered parameters) and its end and the step (the gradients, the fp32
    gradient partition). ZeRO-3's gradient partition stays; with several micro batches per update
    the earlier micro batches' gradients are there when a later backward starts."""
    after = [k for k in AFTER_BACKWARD if not (k == "gradients" and zero_stage == 3)]
    backward = sum(v for k, v in parts.items() if k in BACKWARD_ONLY)
    end = sum(v for k, v in parts.items() if k in after)
    if micro_batches > 1:
        backward += parts.get("gradients", 0.0) if zero_stage < 3 else 0.0
    return (
        sum(parts.values()) - sum(v for k, v in parts.items() if k in BACKWARD_ONLY or k in after) + max(backward, end)
    )


@dataclass(frozen=True)
class LearnerSetup:
    """One learner configuration to predict."""

    ranks: int = 1
    """N: data-parallel ranks (all nodes), ZeRO partitions over all of them."""
    zero_stage: int = 2
    dtype: Literal["fp32", "bf16"] = "bf16"
    seq_len: int = 4096
    """s: tokens of one row (prompt + response, or a packed row)."""
    micro_batch: int = 1
    """Rows per forward/backward on one rank (per sequence-parallel group)."""
    micro_batches: int = 1
    """Micro batches per optimizer update: above 1 the gradients accumulate under the next backward."""
    scored_fraction: float = 0.75
    """Share of the tokens that are scored (response tokens): the logits chunk is the smaller of
    ``logits_chunk_tokens`` and those."""
    gradient_checkpointing: bool = False
    attention: Literal["sdpa", "eager", "flash"] = "sdpa"
    sequence_parallel: int = 1
    """P: ranks that split one sequence (Ulysses)."""
    logits_chunk_tokens: int = 512
    bucket_elements: int | None = None
    """``learner.trainer.zero_bucket_elements``; None: DeepSpeed's 5e8."""
    prefetch_elements: int = 50_000_000
    """ZeRO-3 ``stage3_prefetch_bucket_size`` (DeepSpeed's default 5e7)."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 ``stage3_max_live_parameters`` (DeepSpeed's default 1e9)."""
    max_reuse_distance: int = 1_000_000_000
    """ZeRO-3 ``stage3_max_reuse_distance``: a parameter used again within this many elements stays gathered (DeepSpeed's default 1e9)."""
    persistence_threshold: int = 100_000
    """ZeRO-3 ``stage3_param_persistence_threshold``: smaller tensors stay whole on every rank."""
    optimizer_offload: Literal["none", "cpu", "nvme"] = "none"
    param_offload: Literal["none", "cpu", "nvme"] = "none"
    """ZeRO-3 only."""
    sub_group_elements: int = 1_000_000_000
    """ZeRO-3 ``sub_group_size``: the optimizer steps its partition this many elements at a time,
    each with its own fp32 gradient (DeepSpeed's default 1e9)."""
    nvme_buffer_elements: int = 100_000_000
    """Elements of one NVMe swap buffer on the host (DeepSpeed's ``buffer_size``, 1e8)."""
    nvme_buffers: int = 5
    """Parameter swap buffers on the host (DeepSpeed's ``offload_param.buffer_count``, 5; the optimizer's are 4)."""
    max_in_cpu_params: int = 1_000_000_000
    """param_offload nvme: elements of the partition DeepSpeed also keeps in host memory
    (``offload_param.max_in_cpu``, 1e9; ``learner.trainer.offload.max_in_cpu_params``)."""
    partitioned_load: bool = False
    """The model built partitioned (``zero.Init``; ZeRO-3 only): a rank never holds the whole model."""
    fp32_master_when_fp32: bool = True
    """DeepSpeed's ZeRO-1/2/3 clone an fp32 master of fp32 weights (main's behaviour)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage ({self.zero_stage}) must be 0, 1, 2 or 3")
        for key in ("ranks", "seq_len", "micro_batch", "sequence_parallel", "logits_chunk_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} ({getattr(self, key)}) must be >= 1")
        if self.ranks % self.sequence_parallel:
            raise ValueError(f"ranks ({self.ranks}) must be divisible by sequence_parallel ({self.sequence_parallel})")
        if self.param_offload != "none" and self.zero_stage != 3:
            raise ValueError(f"param_offload ({self.param_offload}) needs zero_stage 3, got {self.zero_stage}")
        if self.optimizer_offload != "none" and self.zero_stage == 0:
            raise ValueError(f"optimizer_offload ({self.optimizer_offload}) needs zero_stage >= 1")
        if self.optimizer_offload == "nvme" and self.zero_stage != 3:
            raise ValueError(f"optimizer_offload nvme needs zero_stage 3 (DeepSpeed's), got {self.zero_stage}")
        if not 0 < self.scored_fraction <= 1:
            raise ValueError(f"scored_fraction ({self.scored_fraction}) must be in (0, 1]")

    @property
    def param_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 4


@dataclass
class MemoryEstimate:
    """Bytes per rank by component and where they live; the peaks."""

    zero_stage: int = 0
    micro_batches: int = 1
    device: dict[str, float] = field(default_factory=dict)
    """Held on the accelerator through the training step (or on the host where device = host)."""
    host: dict[str, float] = field(default_factory=dict)
    """Held in host memory through the step (offloaded state, swap buffers)."""
    nvme: dict[str, float] = field(default_factory=dict)
    load_device: float = 0.0
    """Device bytes while the model is loaded, before training."""
    load_host: float = 0.0
    """Host bytes while the model is loaded (the whole fp32 model unless partitioned)."""

    @property
    def device_train(self) -> float:
        """The training step's peak on the device (``phase_peak``)."""
        return phase_peak(self.device, self.zero_stage, self.micro_batches)

    @property
    def host_train(self) -> float:
        return phase_peak(self.host, self.zero_stage, self.micro_batches)

    @property
    def device_peak(self) -> float:
        return max(self.device_train, self.load_device)

    @property
    def host_peak(self) -> float:
        return max(self.host_train, self.load_host)

    def dominant(self) -> str:
        """The largest device component."""
        return max(self.device, key=self.device.get)

    def to_dict(self) -> dict:
        return {
            "device_bytes": {k: round(v) for k, v in self.device.items()},
            "host_bytes": {k: round(v) for k, v in self.host.items()},
            "nvme_bytes": {k: round(v) for k, v in self.nvme.items()},
            "device_train_bytes": round(self.device_train),
            "host_train_bytes": round(self.host_train),
            "load_device_bytes": round(self.load_device),
            "load_host_bytes": round(self.load_host),
            "device_peak_bytes": round(self.device_peak),
            "host_peak_bytes": round(self.host_peak),
            "dominant": self.dominant(),
        }


def activation_bytes_per_token(shape: ModelShape, setup: LearnerSetup) -> float:
    """Bytes autograd keeps for one token in one block (module docstring; Korthikanti eq. 1 redone)."""
    b, h, f, a = setup.param_bytes, shape.hidden, shape.intermediate, shape.heads
    upcast = 4 * h if b < 4 else 0  # RMSNorm's fp32 copy of its input
    norms = 2 * (3 * b * h + upcast)
    kv = shape.kv_width if setup.attention == "flash" else h  # eager/sdpa repeat k, v to every head
    attention = b * (h + 2 * kv + 2 * h) + 4 * a
    if setup.attention == "eager":
        attention += a * setup.seq_len * (4 + (b if b < 4 else 0))  # softmax fp32 (+ its cast)
    mlp = 4 * b * f
    return norms + attention + mlp


def activations(shape: ModelShape, setup: LearnerSetup) -> float:
    """Bytes of the micro batch's activations on one rank at the start of the backward."""
    tokens = setup.micro_batch * setup.seq_len / setup.sequence_parallel
    per_block = activation_bytes_per_token(shape, setup)
    ends = 3 * setup.param_bytes * shape.hidden  # embedding output, final norm (input, output)
    if setup.gradient_checkpointing:
        # each block's input kept, one block rebuilt at a time in the backward
        return tokens * (shape.layers * setup.param_bytes * shape.hidden + per_block + ends)
    return tokens * (shape.layers * per_block + ends)


def logits(shape: ModelShape, setup: LearnerSetup) -> float:
    """One chunk of scored positions' logits, forward and backward (``asyncrl.learner.logprobs``)."""
    scored = setup.micro_batch * setup.seq_len * setup.scored_fraction / setup.sequence_parallel
    chunk = min(setup.logits_chunk_tokens, max(1.0, scored))
    model_dtype_copy = setup.param_bytes if setup.param_bytes < 4 else 0
    return chunk * shape.vocab * (LOGIT_BUFFERS * 4 + model_dtype_copy)


def predict(shape: ModelShape, setup: LearnerSetup) -> MemoryEstimate:
    """The estimate of one rank (see the module docstring for each term)."""
    psi, n, b = shape.parameters(), setup.ranks, setup.param_bytes
    stage, est = setup.zero_stage, MemoryEstimate(setup.zero_stage, setup.micro_batches)
    bucket = setup.bucket_elements or DEEPSPEED_BUCKET_ELEMENTS
    dev, host, nvme = est.device, est.host, est.nvme

    # -- parameters
    if stage < 3:
        dev["parameters"] = b * psi
    else:
        partition = b * psi / n
        persistent = b * shape.small_parameters(setup.persistence_threshold)
        # Gathered copies: the module in use and the prefetch bucket, and every block that is used
        # again within max_reuse_distance elements, which DeepSpeed keeps instead of releasing:
        # between a block's forward and its backward lie twice the blocks after it, so the last
        # reuse/2 elements of blocks stay through the turn; at most max_live_parameters. One rank
        # gathers nothing: its partition is the whole tensor.
        module = max(shape.block_parameters(), shape.vocab * shape.hidden)
        live = min(psi, setup.max_live_parameters, module + setup.prefetch_elements + setup.max_reuse_distance / 2)
        dev["parameters_gathered"] = (b * live if n > 1 else 0.0) + persistent
        if setup.param_offload == "none":
            dev["parameters"] = partition
        elif setup.param_offload == "cpu":
            host["parameters"] = partition
        else:
            nvme["parameters"] = partition
            host["parameter_swap_buffers"] = setup.nvme_buffers * setup.nvme_buffer_elements * b
            # DeepSpeed keeps up to offload_param.max_in_cpu elements of the partition in a flat
            # host buffer besides the files (``param_groups_fp16_flat_cpu_memory``, stage3.py):
            # the default 1e9 holds a whole partition below a billion elements
            host["parameters_host_copy"] = b * min(psi / n, setup.max_in_cpu_params)

    # -- gradients
    if stage == 0:
        dev["gradients"] = b * psi
        if b == 4:
            dev["allreduce_buffer"] = 4 * min(DEEPSPEED_ALLREDUCE_ELEMENTS, psi)
        else:
            # DeepSpeed's BF16_Optimizer accumulates into fp32 gradients, allocated in the backward
            # and freed after the step; measured on one rank, no flattened copy beside them (with
            # several ranks one is assumed, as without bf16: not measured)
            dev["gradients_fp32_accumulator"] = 4 * psi
            if n > 1:
                dev["allreduce_buffer"] = 4 * min(DEEPSPEED_ALLREDUCE_ELEMENTS, psi)
    elif stage == 1:
        dev["gradients"] = b * psi
        dev["reduce_bucket"] = b * min(bucket, psi)
    else:
        buffers = 2 if stage == 3 else 1  # DeepSpeed overlaps communication at ZeRO-3 by default
        dev["reduce_bucket"] = buffers * b * min(bucket, psi)
        if setup.optimizer_offload == "none":
            dev["gradients"] = b * psi / n
        elif stage == 3:
            # ZeRO-3 reduces every gradient into a flat partition buffer on the optimizer's device
            # (``grad_partitions_flat_buffer``): in host memory when the optimizer is offloaded,
            # to cpu or to nvme alike
            host["gradients"] = b * psi / n

    # -- optimizer state: fp32 master, AdamW's two moments, the step's fp32 gradient partition
    shards = 1 if stage == 0 and b == 4 else n  # the torch optimizer is not partitioned at ZeRO-0
    states = {"adam_moments": 8 * psi / shards}
    if b < 4 or (stage >= 1 and setup.fp32_master_when_fp32):
        states["fp32_master"] = 4 * psi / n
    if stage in (1, 2):
        # the partition flattened (a copy in the training dtype), then cast to fp32: both at once
        # under bf16, one buffer under fp32
        states["fp32_gradient_partition"] = (4 + (b if b < 4 else 0)) * psi / n
    elif stage == 3:
        states["fp32_gradient_partition"] = 4 * min(psi / n, setup.sub_group_elements)  # a sub-group at a time
    if setup.optimizer_offload == "none":
        dev.update(states)
    elif setup.optimizer_offload == "cpu":
        host.update(states)
    else:
        nvme.update(states)
        # DeepSpeed's optimizer swapper: 4 fp32 swap buffers, and the sub-group being updated
        # (its master, two moments and gradient) read into host memory
        sub_group = min(setup.sub_group_elements, psi / n)
        host["optimizer_swap_buffers"] = 4 * setup.nvme_buffer_elements * 4 + 16 * sub_group

    # -- the step's activations and logits
    dev["activations"] = activations(shape, setup)
    dev["logits"] = logits(shape, setup)

    # -- loading: every rank builds the whole fp32 model on the host, then the engine casts it and
    # moves it whole to the device, where ZeRO-3 partitions it. ZeRO-1/2 flatten the parameters
    # through host copies (DeepSpeed moves them to the host first to make room): 2bΨ on the host.
    # Partitioned (zero.Init, ZeRO-3 only): a rank holds its share and one block.
    whole = shape.parameters()
    if setup.partitioned_load and stage == 3:
        est.load_host = 4 * (whole / n + shape.block_parameters())
        est.load_device = b * (whole / n + shape.block_parameters())
    else:
        est.load_host = max(4 * whole, 2 * b * whole)
        est.load_device = b * whole
    return est


def predict_dict(shape: ModelShape, setup: LearnerSetup) -> dict:
    """``predict`` as JSON: the shape, the setup, the components and peaks."""
    est = predict(shape, setup)
    return {
        "shape": asdict(shape),
        "parameters": shape.parameters(),
        "setup": asdict(setup),
        "activation_bytes_per_token_per_block": activation_bytes_per_token(shape, setup),
        **est.to_dict(),
    }
