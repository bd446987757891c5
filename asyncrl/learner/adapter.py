"""The LoRA learner's parts (``model.lora``): the adapter out, the KL reference, the final model.

The policy is a ``peft.PeftModel`` in the DeepSpeed engine (``asyncrl.models.lora.apply_lora``:
base frozen, adapters trainable, the optimizer built on the adapters only). What changes for the
rest of the learner is here:

- **weights out** (``adapter_buckets``): each published version is the adapter's tensors only,
  in size-capped buckets like ``asyncrl.weights.buckets.iter_buckets`` (gathered under ZeRO-3 while
  the caller holds a bucket), named as ``peft.get_peft_model_state_dict`` names them and in the
  model's dtype; the meta's ``adapter`` entry (``asyncrl.models.lora.adapter_meta``) says how to
  load them. The contract with the generators is written in ``asyncrl.models.lora``.
- **the KL reference** (``AdapterOffReference``): the base model is the starting policy, and it
  is already in the engine: the reference is the same weights run with the adapter disabled
  (peft's ``disable_adapter()``), so no second copy of the model is loaded, at any ZeRO stage.
  Under ZeRO-3 its forward passes gather the partitioned base collectively, so it is
  ``collective`` and the step gives every rank as many reference calls (filler rows,
  ``step.reference_logprobs``).
- **the final model** (``save_lora_final``): ``RUN_DIR/final`` holds the merged model (base +
  alpha/r B A, a plain Hugging Face model dir, which the evaluation after RL and vLLM load like a
  full run's), and the adapter itself in peft's format in ``RUN_DIR/final/adapter``
  (``asyncrl export`` writes either).
- **checkpoints** hold the adapter and its optimizer state only (``checkpoint_io`` saves with
  DeepSpeed's ``exclude_frozen_parameters``, within ``adapter_only_checkpoint``): the base is the
  starting model, read again on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from asyncrl.learner.logprobs import TokenDistribution, token_scores
from asyncrl.models.lora import LoraConfig, adapter_parameters, write_lora_model
from asyncrl.weights.buckets import Bucket


def adapter_buckets(module: torch.nn.Module, bucket_bytes: int) -> Iterator[Bucket]:
    """The adapter's tensors of a PeftModel as buckets of ``(wire name, tensor)`` under
    ``bucket_bytes`` (a tensor larger than the cap is a bucket of its own), in module order.

    Collective under ZeRO-3 (every rank iterates to the end); the tensors are valid until the
    next ``next()`` then (``Bucket.transient``), as ``iter_buckets``'s.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be >= 1")
    plans: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, p in adapter_parameters(module):
        nbytes = int(getattr(p, "ds_numel", p.numel())) * p.element_size()
        if not plans or (plans[-1] and size + nbytes > bucket_bytes):
            plans.append([])
            size = 0
        plans[-1].append((name, p))
        size += nbytes
    for plan in plans:
        partitioned = [p for _, p in plan if hasattr(p, "ds_id")]
        gather = contextlib.nullcontext()
        if partitioned:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
        with gather:
            bucket = Bucket((name, p.detach()) for name, p in plan)
            bucket.transient = bool(partitioned)
            yield bucket


def adapter_state_dict(module: torch.nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The adapter's tensors, wire names, fp32 copies on the CPU (the module's dtype widened, as
    ``hf_export.full_state_dict`` does). Collective under ZeRO-3; with ``rank0_only`` other ranks
    get ``{}``."""
    want = not rank0_only or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for bucket in adapter_buckets(module, 1 << 26):
        if want:
            state.update((name, t.to("cpu", torch.float32, copy=True)) for name, t in bucket)
    return state


class AdapterOffReference:
    """The KL reference of a LoRA policy: the engine's own weights with the adapter disabled,
    i.e. the starting model (same interface as ``ColocatedReference``)."""

    def __init__(self, module: torch.nn.Module, chunk_tokens: int = 512, collective: bool = False):
        self.module = module
        """The engine's PeftModel (its ``disable_adapter()`` runs the base alone)."""
        self.chunk_tokens = chunk_tokens
        self.collective = collective
        """Whether a forward pass is collective (ZeRO-3 gathers the partitioned base): every rank
        must then call ``logprobs`` as often as the others."""

    @torch.no_grad()
    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        score_mask: torch.Tensor,
        dist: TokenDistribution,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        was_training = self.module.training
        self.module.eval()  # as the frozen copy runs: no dropout
        try:
            with self.module.disable_adapter():
                scores = token_scores(
                    self.module,
                    input_ids,
                    None if position_ids is not None else attention_mask,  # packed rows: the positions say
                    score_mask,
                    dist,
                    position_ids=position_ids,
                    chunk_tokens=self.chunk_tokens,
                    entropy=False,
                )
        finally:
            self.module.train(was_training)
        return scores.logprobs  # (B, L-1)


@contextlib.contextmanager
def adapter_only_checkpoint(engine):
    """Within the block, the engine's checkpoints hold no frozen tensor at all.

    DeepSpeed's ``exclude_frozen_parameters`` drops the frozen entries of the module's state dict
    by the names ``named_parameters()`` gives, which lists a tied weight once: the output head
    tied to the embedding (SmolLM2's, Qwen2.5-0.5B's) stayed in the checkpoint, 113 MB of
    SmolLM2-135M's 192 MB. Here the state dict keeps the trainable parameters only."""
    original = engine.module_state_dict

    def module_state_dict(destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        state = original(destination, prefix, keep_vars, exclude_frozen_parameters)
        trainable = {prefix + name for name, p in engine.module.named_parameters() if p.requires_grad}
        for key in [k for k in state if k not in trainable]:
            del state[key]
        return state

    engine.module_state_dict = module_state_dict  # DeepSpeed's _save_checkpoint calls self.module_state_dict
    try:
        yield engine
    finally:
        del engine.module_state_dict  # the class's method again


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """``module`` in eval mode for the block (no adapter dropout: the served policy), then back."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def save_lora_final(module: torch.nn.Module, lora: LoraConfig, model_dir: Path, out_dir: str | Path) -> Path:
    """Write a LoRA policy's final model: the merged model as a Hugging Face model dir in
    ``out_dir`` (fp32, the tokenizer and other files of ``model_dir`` copied) and the adapter in
    peft's format in ``out_dir/adapter``. Collective under ZeRO-3; rank 0 writes; every rank
    waits for it. Returns ``out_dir``."""
    out = Path(out_dir)
    tensors = adapter_state_dict(module, rank0_only=True)
    if torch.distributed.get_rank() == 0:
        write_lora_model(tensors, lora, model_dir, out)
    torch.distributed.barrier()
    return out
