"""The policy trainer: a Hugging Face causal LM in a DeepSpeed engine, one optimizer step per batch.

``PolicyTrainer.train_step(groups)`` is one iteration of staleness-corrected GRPO: GRPO advantages
from the groups' rewards, one forward/backward over the batch (in micro batches, their gradients
accumulated), one optimizer step, ``version += 1``. ``full_state_dict()`` and
``save_pretrained()`` hand the new weights to the generators.

One optimizer step per call, whatever the batch size: the DeepSpeed config has
``gradient_accumulation_steps = 1`` and ``train_micro_batch_size_per_gpu = micro_batch_size``, and
``train_step`` owns the accumulation boundary itself: before each micro batch's backward it calls
``engine.set_gradient_accumulation_boundary(is_last_micro_batch)``, calls
``engine.backward(loss, scale_wrt_gas=False)``, and calls ``engine.step()`` once at the end. The
boundary flag tells ZeRO-1/2 when to move the summed gradients into the optimizer's partitions
(and a multi-rank ZeRO-0 when to all-reduce); marking every micro batch a boundary makes stages
1 and 2 drift from a full-batch step, which ``tests/learner/test_trainer.py`` catches. Each micro batch's loss is its token-sum divided by the token
count of the *whole* batch, so the accumulated gradient is exactly that of the batch's token-mean
loss, independent of how the batch is cut into micro batches.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

from asyncrl.learner.advantages import grpo_advantages
from asyncrl.learner.batch import TrainBatch, collate, token_logprobs
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.losses import LOSSES
from asyncrl.wire import Group

# Files of a Hugging Face model dir that ``save_pretrained`` writes itself instead of copying.
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_distributed(backend: str | None = None) -> None:
    """Initialise DeepSpeed's process group for a process that is not launched by a launcher.

    Sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT where unset (a free port), skips the
    CPU shared-memory all-reduce kernel (compiled on first use, 45-120 s, and useless with one
    process), then ``deepspeed.init_distributed``. Idempotent: a second call does nothing.
    ``backend`` defaults to nccl when CUDA is available, else gloo.
    """
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module whose build_shm_op is replaced)

    if torch.distributed.is_initialized() and deepspeed.comm.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    if os.environ["WORLD_SIZE"] == "1":
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


class PolicyTrainer:
    """The learner's model, optimizer and step counter.

    Every rank of a multi-process learner constructs one and calls ``train_step`` with its own
    share of the groups (ZeRO averages gradients over ranks); ``full_state_dict`` and
    ``save_pretrained`` are collective under ZeRO-3 and must be called on every rank.
    """

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig):
        # Imported before DeepSpeed's ZeRO-3 machinery runs: their first import must not happen
        # while zero.Init has patched module construction.
        import deepspeed
        import torch._dynamo  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM

        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.version = 0
        """Optimizer steps taken; the policy version of the current weights."""
        self.loss_fn = LOSSES[cfg.loss]

        if not torch.distributed.is_initialized():
            init_single_process_distributed()
        torch.manual_seed(cfg.seed)

        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        pad_id = getattr(self.hf_config, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(pad_id, list):
            pad_id = pad_id[0]
        # Padding is never attended to nor trained on; any id in the vocabulary will do.
        self.pad_id = int(pad_id) if pad_id is not None else 0

        # The full fp32 model is loaded on each rank, then DeepSpeed casts it (bf16) and, under
        # ZeRO-3, partitions it. Fine for models that fit in host memory once per rank.
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.config.use_cache = False
        model.train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        ds_config = {
            # One micro batch per "DeepSpeed step"; train_step owns the accumulation boundary.
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": cfg.zero_stage},
            "bf16": {"enabled": cfg.dtype == "bf16"},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.device = self.engine.device

    # -----------------------------------------------------------------------------------------
    # training

    def advantages(self, groups: list[Group]) -> list[np.ndarray]:
        """GRPO advantages of each group's samples, one (n_g,) array per group."""
        rows = []
        for group in groups:
            if not group.scored:
                raise ValueError(f"group {group.group_id}: every sample needs a reward before training")
            rewards = np.asarray([[s.reward for s in group.samples]], dtype=np.float32)  # (1, n)
            rows.append(grpo_advantages(rewards, scale_by_std=self.cfg.scale_advantages_by_std)[0])
        return rows

    def weighted_advantages(self, groups: list[Group], weights=None) -> list[np.ndarray]:
        """GRPO advantages, each group's row scaled by its weight (a replay buffer's importance
        weight w_g); ``None``: unweighted.

        Scaling group g's advantages by w_g >= 0 is exactly weighting each of its tokens' loss by
        w_g: the decoupled PPO loss is linear in A for a non-negative factor,
        max(-w·A·ratio, -w·A·clip(ratio)) = w·max(-A·ratio, -A·clip(ratio)), and the behaviour
        weight and the token mean are untouched; so no loss function needs a weight argument.
        """
        rows = self.advantages(groups)
        if weights is None:
            return rows
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if w.size != len(groups):
            raise ValueError(f"weights has {w.size} entries, must have one per group ({len(groups)})")
        if not (np.isfinite(w).all() and (w >= 0).all()):
            raise ValueError(f"weights ({w.tolist()}) must be finite and >= 0")
        return [row * wg for row, wg in zip(rows, w)]

    def train_step(self, groups: list[Group], weights=None) -> dict:
        """One optimizer step on ``groups``, each group's per-token loss scaled by ``weights[g]``
        (importance weights from a prioritized buffer; None: all 1); returns its stats.

        Stats: ``version`` (after the step), ``loss`` (the batch's token-mean loss), the loss's
        stats averaged over tokens (``*_max`` stats: max), ``grad_norm`` (before clipping),
        ``staleness`` (one int per sequence: ``version before the step - group.policy_version``),
        ``staleness_mean``/``staleness_max``, ``reward_mean``, ``sequences``, ``tokens`` (response
        tokens trained on), ``seconds``.
        """
        start = time.perf_counter()
        cfg = self.cfg
        version_before = self.version
        batch = collate(groups, self.weighted_advantages(groups, weights), self.pad_id)
        total_tokens = max(batch.num_tokens, 1)
        num_rows = len(batch)
        bounds = list(range(0, num_rows, cfg.micro_batch_size))

        self.engine.train()
        loss_total = 0.0
        token_stats: dict[str, float] = {}
        max_stats: dict[str, float] = {}
        for index, lo in enumerate(bounds):
            micro = batch.slice(lo, min(lo + cfg.micro_batch_size, num_rows)).to(self.device)
            micro_tokens = micro.num_tokens
            # Only the last micro batch is an accumulation boundary: ZeRO-1/2 hand the summed
            # gradients to the optimizer partitions there, not after every micro batch.
            self.engine.set_gradient_accumulation_boundary(index == len(bounds) - 1)
            out = self.engine(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False)
            logprobs = token_logprobs(out.logits, micro.input_ids, cfg.temperature)  # (b, l-1)
            # One optimizer step per batch: the proximal policy is the current one (ratio == 1).
            loss, stats = self.loss_fn(
                logprobs,
                logprobs.detach(),
                micro.behaviour_logprobs,
                micro.advantages,
                micro.response_mask,
                clip_coef=cfg.clip_coef,
                behaviour_weight_cap=cfg.behaviour_weight_cap,
            )
            # loss is this micro batch's token-mean; re-weight it to its share of the batch's.
            scaled = loss * (micro_tokens / total_tokens)
            self.engine.backward(scaled, scale_wrt_gas=False)
            loss_total += scaled.item()
            for key, value in stats.items():
                if key == "num_tokens":
                    continue
                if key.endswith("_max"):
                    max_stats[key] = max(max_stats.get(key, -math.inf), value)
                else:
                    token_stats[key] = token_stats.get(key, 0.0) + value * micro_tokens / total_tokens
        own_grad_norm = None
        if self.cfg.zero_stage == 0 and self.cfg.dtype == "fp32":
            # DeepSpeed clips fp32 ZeRO-0 gradients without recording the norm; measure it here.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            if grads:
                own_grad_norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g) for g in grads])
                ).item()
        self.engine.step()
        self.version += 1

        grad_norm = own_grad_norm if own_grad_norm is not None else self.engine.get_global_grad_norm()
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()
        staleness = (version_before - batch.policy_version).tolist()
        rewards = [s.reward for g in groups for s in g.samples]
        return {
            "version": self.version,
            "loss": loss_total,
            **token_stats,
            **max_stats,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "staleness": staleness,
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": int(max(staleness)),
            "reward_mean": float(np.mean(rewards)),
            "sequences": num_rows,
            "tokens": batch.num_tokens,
            "seconds": time.perf_counter() - start,
        }

    # -----------------------------------------------------------------------------------------
    # weights out

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full weights, HF names (``model.layers.0.self_attn.q_proj.weight``...), fp32 on CPU.

        Collective under ZeRO-3 (each module's partitions are all-gathered in turn, copied, and
        released, so at most one module is whole at a time): call it on every rank. With
        ``rank0_only`` other ranks get ``{}`` (saves a host copy of the model per rank).
        Under bf16 these are the bf16 module weights the generators will run, widened to fp32.
        """
        want = not rank0_only or torch.distributed.get_rank() == 0
        module = self.engine.module
        if self.cfg.zero_stage < 3:
            if not want:
                return {}
            return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in module.state_dict().items()}

        import deepspeed

        state: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # ds_id -> copy, so tied weights stay one tensor

        def visit(mod: torch.nn.Module, prefix: str) -> None:
            params = list(mod.parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if want:
                    for name, param in mod.named_parameters(recurse=False):
                        key = getattr(param, "ds_id", id(param))
                        if key not in copies:
                            # copy=True: on CPU .to("cpu") would alias the gathered buffer,
                            # which is freed (and reused) when the context exits.
                            copies[key] = param.detach().to("cpu", torch.float32, copy=True)
                        state[prefix + name] = copies[key]
                    for name, buf in mod.named_buffers(recurse=False):
                        if buf is not None and name not in mod._non_persistent_buffers_set:
                            state[prefix + name] = buf.detach().to("cpu", torch.float32, copy=True)
            for name, child in mod.named_children():
                visit(child, prefix + name + ".")

        visit(module, "")
        return state

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write a Hugging Face model dir (config, fp32 ``model.safetensors``, tokenizer files).

        Collective under ZeRO-3; rank 0 writes. The tokenizer and generation config are copied
        from ``model_dir``. Returns ``out_dir``.
        """
        from safetensors.torch import save_file

        out = Path(out_dir)
        state = self.full_state_dict(rank0_only=True)
        if torch.distributed.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            for path in self.model_dir.iterdir():
                if (
                    path.is_file()
                    and path.name != "config.json"
                    and path.name not in _WEIGHT_INDEX_FILES
                    and not path.name.endswith(_WEIGHT_FILE_SUFFIXES)
                ):
                    shutil.copy2(path, out / path.name)
            if getattr(self.hf_config, "tie_word_embeddings", False):
                # A tied output head is the embedding: HF stores it once and re-ties on load.
                state.pop("lm_head.weight", None)
            # safetensors refuses tensors that share memory; give each key its own.
            seen: set[int] = set()
            for key, tensor in list(state.items()):
                if id(tensor) in seen:
                    state[key] = tensor.clone()
                seen.add(id(tensor))
            save_file(
                {k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
            )
            config = self.hf_config.__class__.from_dict(self.hf_config.to_dict())
            config.dtype = "float32"
            config.save_pretrained(out)
        torch.distributed.barrier()
        return out

    def train_batch(self, groups: list[Group], weights=None) -> TrainBatch:
        """The collated batch ``train_step`` would train on (for inspection and tests)."""
        return collate(groups, self.weighted_advantages(groups, weights), self.pad_id)
