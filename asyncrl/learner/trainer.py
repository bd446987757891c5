"""The policy trainer: a Hugging Face causal LM in a DeepSpeed engine, one learner step per batch.

``PolicyTrainer.train_step(groups)`` is one iteration of the algorithm the run's ``algorithm``
section names (default: decoupled GRPO): advantages from the groups' rewards
(``ADV_ESTIMATORS``), then ``ppo_epochs`` passes over the batch cut into ``mini_batches``
mini-batches of whole groups, each one forward/backward (in micro batches, their gradients
accumulated) of the corrected policy loss (``compute_policy_loss``) plus the KL and entropy
terms and one optimizer update; then ``version += 1``. ``full_state_dict()`` and
``save_pretrained()`` hand the new weights to the generators.

What the version counts. ``policy_version`` is the learner's step count: one per batch, however
many optimizer updates the step takes (with the defaults, one: then it is the optimizer-step
count). Only a step's final weights are ever published, so the versions a sample can carry are
exactly the learner's steps; staleness (``version at the update - policy_version``), the
buffer's ``max_staleness``, the dispatcher's admission (B groups per version),
``learner.broadcast_every``, ``learner.total_steps`` and ``checkpoint.every_steps`` all count
batches, and keep their meaning whatever ``ppo_epochs`` and ``mini_batches`` are (AReaL and
PRIME-RL count the same way). The learning-rate schedule counts optimizer updates (``updates``).

Several updates per batch (PPO's epochs and mini-batches, Schulman et al. 2017). pi_prox — the
decoupled objective's proximal policy, plain PPO's old policy — is the policy before the step's
first update, computed once by a no-grad forward pass (``proximal_logprobs``); every update's
ratio and clip are taken against it (or against mu, for ``correction: behaviour_ppo``), and the
advantages, the reference's logprobs and the importance weights pi_prox / mu are computed once.
With one update per step there is no extra forward: pi_prox is that update's own logprobs,
detached, and the step is exactly the single-update form. Mini-batches are runs of whole groups
in batch order, the same each epoch, as verl cuts them (OpenRLHF reshuffles each epoch); a
group is never split, so group statistics stay within one update. The critic (``gae``) takes
one update per step.

The KL reference is a frozen copy of the starting weights, run without gradient, in each rank
(``kl.reference: colocated``: whole and without a DeepSpeed engine under ZeRO 0-2, partitioned
in an engine without optimizer under ZeRO-3) or in its own process (``kl.reference: process``,
see ``asyncrl.learner.reference``); it is used only when
``algorithm.kl.coef > 0`` or by online DPO. As a reward penalty the per-token KL is taken between the behaviour
logprobs mu and the reference (the policy that sampled the answer, as OpenRLHF does at
experience time), so it needs no extra policy forward pass.

With ``algorithm.objective: online_dpo`` the step is ``asyncrl.learner.online_dpo``'s instead: a
preference loss on pairs drawn from each group by reward, against the same frozen reference.

The class is a thin composition, one module per job: ``deepspeed_setup`` (process group,
engine, ZeRO config, learning-rate schedule wiring), ``group_advantages`` and ``step`` (the
training step's stages), ``critic`` (the value model, for ``gae``), ``hf_export`` (weights out)
and ``checkpoint_io`` (save and restore).

LoRA (``model.lora``, passed as ``lora``): the loaded model is wrapped by
``asyncrl.models.lora.apply_lora`` before DeepSpeed sees it, the optimizer holds only the
adapters, and weights out, the KL reference, checkpoints and the final model are the adapter's
(``asyncrl.learner.adapter``). Without it (None) nothing changes: full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from asyncrl.learner.adapter import AdapterOffReference, adapter_buckets, eval_mode, save_lora_final
from asyncrl.learner.attention import varlen_attention
from asyncrl.learner.batch import TrainBatch, collate
from asyncrl.learner.checkpoint_io import load_policy_state, save_policy_state
from asyncrl.learner.config import AlgorithmConfig, TrainerConfig
from asyncrl.learner.critic import CriticTrainer
from asyncrl.learner.data_parallel import DataParallel
from asyncrl.learner.deepspeed_setup import (
    deepspeed_engine,
    init_learner_group,
    optimizer_update,
    set_scheduled_lr,
)
from asyncrl.learner.group_advantages import group_advantages, weighted_advantages
from asyncrl.learner.hf_export import full_state_dict, save_pretrained
from asyncrl.learner.kl import make_kl_controller
from asyncrl.learner.logprobs import TokenDistribution, TokenScores, token_scores
from asyncrl.learner.offload import adamw_optimizer
from asyncrl.learner.online_dpo import online_dpo_step
from asyncrl.learner.packing import MicroBatchPlan, pack
from asyncrl.learner.partitioned_load import build_causal_lm
from asyncrl.learner.reference import ColocatedReference, PartitionedReference, RemoteReference
from asyncrl.learner.step import mini_batch_bounds, train_step
from asyncrl.learner.ulysses import SequenceParallel, check_heads, register_attention
from asyncrl.models.lora import (
    LoraConfig,
    adapter_meta,
    apply_lora,
    trainable_parameters,
)
from asyncrl.models.precision import resolve_trainer_dtype
from asyncrl.observability.step_stats import StepStats
from asyncrl.wire.schema import Group


class PolicyTrainer:
    """The learner's model, optimizer and step counter.

    Every rank of a multi-process learner (``learner.ranks``) constructs one and calls
    ``train_step`` with the same whole batch; each trains its own share of the groups
    (``asyncrl.learner.sharding``). ``full_state_dict``, ``weight_buckets``, ``probe`` and
    ``save_pretrained`` are collective under ZeRO-3 and must be called on every rank.
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainerConfig,
        algo: AlgorithmConfig | None = None,
        reference_address: str | None = None,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        lora: LoraConfig | None = None,
        sequence_parallel: int = 1,
    ):
        # Imported before DeepSpeed's ZeRO-3 machinery runs: their first import must not happen
        # while zero.Init has patched module construction.
        import torch._dynamo  # noqa: F401
        from transformers import AutoConfig

        # bf16_if_native is decided here, on the hardware that trains (asyncrl.models.precision).
        cfg = cfg.model_copy(update={"dtype": resolve_trainer_dtype(cfg.dtype)})
        self.cfg = cfg
        self.algo = algo if algo is not None else AlgorithmConfig()
        self.model_dir = Path(model_dir)
        self.lora = lora
        """The LoRA adapters' config (``model.lora``); None: full fine-tuning."""
        if ppo_epochs < 1 or mini_batches < 1:
            raise ValueError(f"ppo_epochs ({ppo_epochs}) and mini_batches ({mini_batches}) must be >= 1")
        self.ppo_epochs = ppo_epochs
        """Passes over each batch (``learner.ppo_epochs``)."""
        self.mini_batches = mini_batches
        """Optimizer updates per pass, each on a run of whole groups (``learner.mini_batches``)."""
        self.version = 0
        """Learner steps taken (one per batch, ``ppo_epochs × mini_batches`` optimizer updates
        each); the policy version of the current weights."""
        self.updates = 0
        """Optimizer updates taken: the index of the learning-rate schedule."""
        if cfg.lr_schedule != "constant" and cfg.lr_decay_steps is None:
            raise ValueError(
                f"lr_schedule ({cfg.lr_schedule}) needs lr_decay_steps (the learner sets it from learner.total_steps), got None"
            )
        self.kl_controller = make_kl_controller(self.algo.kl)
        if self.algo.truncation.mode == "penalise" and self.algo.truncation.max_tokens is None:
            raise ValueError(
                "algorithm.truncation.mode (penalise) needs algorithm.truncation.max_tokens "
                "(the learner sets it from sampling.max_tokens), got None"
            )

        if not torch.distributed.is_initialized():
            init_learner_group(cfg.collective_timeout_s)
        self.dp = DataParallel.of_process(cfg.collective_timeout_s, sequence_parallel)
        """This rank's place in the learner's data-parallel group (one rank: a group of one)."""
        torch.manual_seed(cfg.seed)

        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.pad_id = _pad_id(self.hf_config)

        # ZeRO 0-2: the full fp32 model on each rank, which DeepSpeed casts (bf16). ZeRO-3: built
        # partitioned and loaded module by module, never whole on a rank (``partitioned_load``).
        build_cfg, kv_repeat = cfg, 1
        if sequence_parallel > 1:
            kv_repeat = self._check_sequence_parallel(sequence_parallel)
            # the exchanging attention (plain sdpa outside the step's passes), for the policy alone
            build_cfg = cfg.model_copy(update={"attn_implementation": register_attention()})
        model = build_causal_lm(self.model_dir, build_cfg)
        model.config.use_cache = False
        if cfg.gradient_checkpointing:
            # Non-reentrant: works under ZeRO-3 and with inputs that need no gradient.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:
            model = apply_lora(model, lora)  # base frozen, adapters trainable
        model.train()
        self.distribution = TokenDistribution(cfg.temperature, cfg.top_k, cfg.top_p)
        """The generators' sampling distribution, which every token is scored under."""
        # Packed rows: one per micro batch where attention is variable-length (flash-attention),
        # else as long as the longest sequence (``asyncrl.learner.attention``, ``packing``).
        self.row_tokens = cfg.micro_batch_tokens if varlen_attention(cfg.attn_implementation) else None
        """Token slots of a packed row (``micro_batch_tokens`` under flash-attention), else None:
        the policy's, the reference's and the critic's forwards share these micro batches."""
        # all of them, or with LoRA the adapters alone
        optimizer = adamw_optimizer(trainable_parameters(model), cfg, cfg.lr, cfg.weight_decay)
        self.engine = deepspeed_engine(model, optimizer, cfg)
        set_scheduled_lr(self.engine, cfg, self.updates)  # the first update's rate (warm-up starts below lr)
        self.device = self.engine.device
        self.sequence = None
        """This rank's sequence-parallel group (``learner.sequence_parallel``); None: off."""
        if sequence_parallel > 1:
            self.sequence = SequenceParallel(
                self.dp.seq_group, sequence_parallel, self.dp.seq_rank, kv_repeat, self.pad_id
            )
        self.critic = None
        """The value model's trainer, for ``adv_estimator: gae``; None otherwise."""
        if self.algo.adv_estimator == "gae":
            self.critic = CriticTrainer(self.model_dir, self.algo.critic, cfg, self.pad_id)
        self.reference = None
        """Frozen reference policy (the starting weights) of the KL term or of online DPO; None when neither is used."""
        if self.algo.uses_reference:  # the KL term's, or online DPO's
            if self.algo.kl.reference == "process":
                if reference_address is None:
                    raise ValueError("algorithm.kl.reference (process) needs the reference process's address")
                self.reference = RemoteReference(reference_address)
            elif lora is not None:  # the base is in the engine: run it with the adapter off
                self.reference = AdapterOffReference(self.engine.module, cfg.logits_chunk_tokens, cfg.zero_stage == 3)
            elif cfg.zero_stage == 3:  # partitioned like the policy: a share of it on each rank
                self.reference = PartitionedReference(str(self.model_dir), cfg)
            else:
                dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
                self.reference = ColocatedReference(
                    str(self.model_dir), self.device, dtype, cfg.logits_chunk_tokens, cfg.attn_implementation
                )

    def _check_sequence_parallel(self, n: int) -> int:
        """Refuse what sequence parallelism does not run (naming the rule); the KV heads'
        repetition factor (``ulysses.check_heads``)."""
        if self.algo.adv_estimator == "gae":
            raise ValueError(
                f"learner.sequence_parallel ({n}) does not run the critic: algorithm.adv_estimator 'gae' needs "
                "learner.sequence_parallel 1"
            )
        if self.algo.objective == "online_dpo":
            raise ValueError(
                f"learner.sequence_parallel ({n}) runs the policy-gradient step only: algorithm.objective "
                "'online_dpo' needs learner.sequence_parallel 1"
            )
        text = self.hf_config.get_text_config()
        heads = text.num_attention_heads
        return check_heads(heads, getattr(text, "num_key_value_heads", None) or heads, n)

    # -----------------------------------------------------------------------------------------
    # training

    def advantages(self, groups: list[Group], rewards: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Advantages of each group's samples, one (n_g,) array per group
        (``group_advantages.group_advantages``; for gae, the group-centred rewards stand in)."""
        return group_advantages(self.algo, groups, rewards)

    def train_step(self, groups: list[Group], weights=None) -> StepStats:
        """One learner step on ``groups``, each group's policy loss scaled by ``weights[g]``
        (importance weights from a prioritized buffer; None: all 1); returns its stats.

        The step's stages are ``asyncrl.learner.step``'s: the shaped rewards and the padded batch,
        the reference's logprobs, the advantages, pi_prox (only when the step takes several
        updates), then ``ppo_epochs`` passes over ``mini_batches`` mini-batches of whole groups,
        one optimizer update each; ``version += 1`` once, at the end.

        Returns the step's ``StepStats`` (``asyncrl.observability.step_stats``: one declared field
        per statistic, each with what it measures).
        """
        if self.algo.objective == "online_dpo":  # a preference loss on each group's pairs instead
            return online_dpo_step(self, groups, weights)
        return train_step(self, groups, weights)

    def _mini_batches(self, groups: list[Group]) -> list[tuple[int, int]]:
        """Row ranges of the step's mini-batches (``step.mini_batch_bounds``)."""
        return mini_batch_bounds(groups, self.mini_batches)

    def optimizer_update(self) -> tuple[float, float]:
        """One optimizer update on the accumulated gradients (``deepspeed_setup.optimizer_update``);
        returns its learning rate and the gradient norm before clipping."""
        lr, grad_norm = optimizer_update(self.engine, self.cfg, self.updates)
        self.updates += 1
        return lr, grad_norm

    def score(self, micro: TrainBatch, entropy: bool, plan: MicroBatchPlan | None = None) -> TokenScores:
        """pi_theta's log-probabilities (and entropy) of one micro batch's response tokens, (b, l-1)
        each, under the sampling distribution, in memory bounded per token (``token_scores``).

        With a packed ``plan`` the forward pass runs on the sequences packed into rows, and the
        results come back in the micro batch's padded layout (``asyncrl.learner.packing``).
        Under sequence parallelism this rank runs its shard of the rows (``asyncrl.learner.ulysses``)."""
        if self.sequence is not None:
            return self._sequence_parallel_score(micro, entropy, plan)
        if plan is None or plan.placement is None:
            return token_scores(
                self.engine,
                micro.input_ids,
                micro.attention_mask,
                micro.response_mask,
                self.distribution,
                chunk_tokens=self.cfg.logits_chunk_tokens,
                entropy=entropy,
                entropy_grad=self.algo.entropy_coef > 0,  # else kept out of the backward
            )
        packed = pack(micro.input_ids, micro.attention_mask, micro.response_mask, plan, self.pad_id)
        scores = token_scores(
            self.engine,
            packed.input_ids,
            None,  # attention stays within each sequence: Hugging Face reads the boundaries from position_ids
            packed.score_mask,
            self.distribution,
            position_ids=packed.position_ids,
            chunk_tokens=self.cfg.logits_chunk_tokens,
            entropy=entropy,
            entropy_grad=self.algo.entropy_coef > 0,  # else kept out of the backward
        )
        return TokenScores(*(packed.unpack(x, micro.response_mask) for x in scores))

    def _sequence_parallel_score(self, micro: TrainBatch, entropy: bool, plan: MicroBatchPlan | None) -> TokenScores:
        """``score`` under sequence parallelism: right-padded rows get positions 0, 1, ...
        (causal attention keeps the padding out of every real token's view), packed rows theirs."""
        kwargs = dict(
            dist=self.distribution,
            chunk_tokens=self.cfg.logits_chunk_tokens,
            entropy=entropy,
            entropy_grad=self.algo.entropy_coef > 0,
        )
        if plan is None or plan.placement is None:
            b, L = micro.input_ids.shape
            positions = torch.arange(L, device=micro.input_ids.device).expand(b, L)
            return self.sequence.token_scores(self.engine, micro.input_ids, positions, micro.response_mask, **kwargs)
        packed = pack(micro.input_ids, micro.attention_mask, micro.response_mask, plan, self.pad_id)
        scores = self.sequence.token_scores(
            self.engine, packed.input_ids, packed.position_ids, packed.score_mask, **kwargs
        )
        return TokenScores(*(packed.unpack(x, micro.response_mask) for x in scores))

    def train_batch(self, groups: list[Group], weights=None) -> TrainBatch:
        """The collated batch ``train_step`` would train on, without a KL reward penalty (for
        inspection and tests)."""
        return collate(groups, weighted_advantages(self.algo, groups, weights), self.pad_id)

    # -----------------------------------------------------------------------------------------
    # weights out

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full weights, HF names, fp32 on CPU (``hf_export.full_state_dict``). Collective
        under ZeRO-3; with ``rank0_only`` other ranks get ``{}``."""
        return full_state_dict(self.engine.module, self.cfg.zero_stage, rank0_only)

    def weight_buckets(self, bucket_bytes: int):
        """The weights as size-capped buckets of ``(HF name, tensor)``, for ``asyncrl.weights``
        publishers: under ZeRO-3 each bucket is gathered only while the caller holds it, so the
        extra memory is one bucket, not the model. Collective under ZeRO-3 (iterate on every
        rank); tied weights appear once; tensors keep the module dtype (bf16 under bf16).
        With LoRA: the adapter's tensors only, named as peft's ``get_peft_model_state_dict``
        names them (``adapter.adapter_buckets``)."""
        from asyncrl.weights.buckets import iter_buckets

        if self.lora is not None:
            return adapter_buckets(self.engine.module, bucket_bytes)
        return iter_buckets(self.engine.module, bucket_bytes)

    @property
    def adapter_meta(self) -> dict | None:
        """With LoRA, the ``adapter`` entry of each publication's meta (``asyncrl.models.lora.adapter_meta``:
        rank, alpha, target modules, base version 0); None for full weights."""
        return None if self.lora is None else adapter_meta(self.lora)

    def probe(self, max_len: int | None = None) -> dict:
        """The learner's logprobs of the fixed probe text (``asyncrl.weights.probe``), cut to fit
        ``max_len`` tokens (the engine's ``max_model_len``), sent with each version so the
        generators can check what they serve. Collective under ZeRO-3. With LoRA the adapter is
        on (the served policy), without dropout."""
        from transformers import AutoTokenizer

        from asyncrl.weights.probe import learner_probe

        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if self.lora is not None:
            with eval_mode(self.engine.module):
                return learner_probe(self.engine.module, self._tokenizer, max_len=max_len)
        return learner_probe(self.engine.module, self._tokenizer, max_len=max_len)

    def decode(self, ids) -> str:
        """Token ids as text, special tokens kept (an episode's transcript shows its turn markup)."""
        from transformers import AutoTokenizer

        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write a Hugging Face model dir (config, fp32 ``model.safetensors``, tokenizer files;
        ``hf_export.save_pretrained``). Collective under ZeRO-3; rank 0 writes. Returns ``out_dir``.
        With LoRA: the merged model, and the adapter (peft format) in ``out_dir/adapter``
        (``adapter.save_lora_final``)."""
        if self.lora is not None:
            return save_lora_final(self.engine.module, self.lora, self.model_dir, out_dir)
        return save_pretrained(self.engine.module, self.cfg.zero_stage, self.hf_config, self.model_dir, out_dir)

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def save_state(self, out_dir: str | Path) -> None:
        """Everything a resume needs to continue bit for bit (``checkpoint_io.save_policy_state``).
        Collective: every rank calls it."""
        save_policy_state(self, out_dir)

    def load_state(self, in_dir: str | Path) -> None:
        """Restore what ``save_state`` wrote (the same config, the same number of ranks)."""
        load_policy_state(self, in_dir)

    def close(self) -> None:
        """Release the DeepSpeed engines this trainer built (policy, critic, partitioned reference;
        ``deepspeed_setup.release_engine``) and its reference client: a process that builds
        trainers one after another would otherwise keep every one. The trainer is unusable after."""
        from asyncrl.learner.deepspeed_setup import release_engine

        release_engine(self.engine)
        if self.critic is not None:
            release_engine(self.critic.engine)
        if isinstance(self.reference, PartitionedReference):
            release_engine(self.reference.engine)
        elif isinstance(self.reference, RemoteReference):
            self.reference.close()


def _pad_id(hf_config) -> int:
    """The id that pads rows: the model's pad token, else its (first) end-of-sequence token, else 0.
    Padding is never attended to nor trained on; any id in the vocabulary will do."""
    pad_id = getattr(hf_config, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(hf_config, "eos_token_id", None)
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    return int(pad_id) if pad_id is not None else 0
