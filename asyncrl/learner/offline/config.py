"""``OfflineConfig``: the recipe of an ``asyncrl sft`` or ``asyncrl dpo`` run.

Its own root config, not ``RunConfig``: an offline run has no generators, buffer or rewards, and a
recipe that named them would be a mistake. The sections it shares with RL are RL's own classes
(``learner.trainer`` is the ``TrainerConfig`` of the RL learner: ZeRO stage, precision, learning
rate and its schedule, micro batches and packing; ``logging``, ``checkpoint``, ``model.tiny``), so
a key means the same in both. ``load_offline_config(recipe, overrides)`` reads a YAML recipe with
dotted overrides, as ``asyncrl train`` does; the resolved config is written to
``RUN_DIR/config.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config, UserValueError, apply_overrides, load_yaml
from asyncrl.learner.config import TrainerConfig
from asyncrl.models.lora import LoraConfig
from asyncrl.models.tiny import TinyModelConfig
from asyncrl.observability.loggers import LoggingConfig

ObjectiveKind = Literal["sft", "dpo"]


class OfflineRunSection(Config):
    name: str = "sft"
    """Run name; the run directory is ``{root}/{name}``."""
    root: str = "runs"
    """Folder that holds run directories (relative to the working directory)."""
    seed: int = 0
    """Seed of everything random: the tiny model's weights, the data order, the held-out split."""
    overwrite: bool = True
    """Replace an existing run directory of the same name instead of refusing to start."""
    console: Literal["live", "plain", "quiet", "jsonl"] = "plain"
    """Progress on stdout: plain (a line per logged step; live is taken as plain), quiet, jsonl (a JSON object per logged step)."""
    log_every: int = Field(10, ge=1)
    """Print (and log to TensorBoard/W&B) the training figures every this many steps."""


class OfflineModelSection(Config):
    path: str | None = None
    """A Hugging Face model directory, or a known model's name (``smollm2-135m-instruct``), fetched into the cache if missing; None builds the tiny model below."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the tiny Qwen2 built when ``path`` is None (its seed is ``run.seed``)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (``peft``, ``asyncrl.models.lora``) on the frozen model instead of all its weights; set any key (``model.lora.rank=16``) to enable. None: full fine-tuning."""


class OfflineDataConfig(Config):
    """Where the examples come from and how a row becomes one."""

    train: str
    """Training rows: a .jsonl / .jsonl.gz / .parquet file, a folder written by datasets' save_to_disk, 'hf://owner/name:config', or 'addition' (two-digit sums generated here: prompt/response rows, or correct/wrong pairs for dpo)."""
    test: str | None = None
    """Held-out rows, same forms as ``train``; None: the last ``test_size`` rows of ``train`` are held out (never trained on)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """File format; 'auto' goes by the suffix and treats a folder as a saved dataset."""
    messages_key: str = "messages"
    """Column of a chat row: a list of {role, content} turns. Used when the row has it; else the prompt/response (or pair) columns."""
    prompt_key: str = "prompt"
    """Column of the prompt (one user turn) when rows are not chats."""
    response_key: str = "response"
    """Column of the response to learn (SFT), one assistant turn."""
    chosen_key: str = "chosen"
    """Column of the preferred response (DPO): text, or a list of turns ending in the assistant's."""
    rejected_key: str = "rejected"
    """Column of the dispreferred response (DPO), same form as ``chosen_key``."""
    answer_key: str | None = None
    """Column of the reference answer scored by exact match; None: the last assistant turn (SFT) or the chosen response (DPO), its number after '####' when written GSM8K-style."""
    prompt_template: str = "{prompt}"
    """Text of the user turn with ``{prompt}`` in it, e.g. 'Question: {prompt}\\nAnswer:'."""
    system_prompt: str | None = None
    """System turn placed before the first user turn of prompt/response rows."""
    chat_template: Literal["auto", "model", "none"] = "auto"
    """Render with the tokenizer's chat template ('model': required), plain text ('none': prompt then response then eos), or 'auto': the template when the tokenizer has one."""
    max_tokens: int = Field(512, ge=2)
    """Longest example in tokens (prompt + response); longer ones are dropped at load, counted and logged."""
    test_size: int = Field(200, ge=1)
    """Held-out rows: the first test_size of ``test`` (or the last of ``train`` when test is None)."""
    max_train_rows: int | None = Field(None, ge=1)
    """Read only the first this many training rows (None: all)."""
    addition_wrong: Literal["near", "random"] = "near"
    """For the generated 'addition' pairs: the rejected answer is off by 1-10 ('near') or any other sum ('random')."""

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError(f"prompt_template ({value!r}) must contain {{prompt}}")
        return value


class ObjectiveConfig(Config):
    """What the loop minimises over a batch (``asyncrl.learner.offline.objective``)."""

    kind: ObjectiveKind = "sft"
    """sft: the mean negative log-likelihood of the assistant tokens; dpo: a preference loss on chosen/rejected pairs."""
    beta: float = Field(0.1, gt=0)
    """DPO's beta (IPO's tau): how strongly the policy is held to the reference."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """DPO variant (``asyncrl.learner.preference_losses``): sigmoid (DPO), ipo, hinge (SLiC)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO's label noise eps (sigmoid only)."""
    sft_weight: float = Field(0.0, ge=0)
    """DPO: add this times the chosen responses' token-mean NLL (RPO); 0: pure preference loss."""


class OfflineTrainingConfig(Config):
    steps: int = Field(100, ge=1)
    """Optimizer steps (one per batch)."""
    batch_size: int = Field(32, ge=1)
    """Examples per step, over every rank (a DPO pair is one example)."""
    ranks: int = Field(1, ge=1)
    """Data-parallel learner processes (DeepSpeed ranks) on this machine, started as RL's learner ranks are."""


class LearnerSection(Config):
    trainer: TrainerConfig = TrainerConfig(lr=1e-5, lr_schedule="cosine", lr_warmup_steps=10, min_lr_ratio=0.1)
    """RL's trainer section (``asyncrl show-config``'s ``learner.trainer``); the schedule counts this run's steps."""


class OfflineEvalConfig(Config):
    every_steps: int = Field(0, ge=0)
    """Evaluate every this many steps (0: only before the first step and after the last)."""
    num_prompts: int = Field(100, ge=0)
    """Held-out examples whose greedy answer is scored by exact match (0: loss only)."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest greedy answer."""
    batch_size: int = Field(64, ge=1)
    """Prompts decoded together."""
    task: str | None = None
    """Scoring rule of ``asyncrl.tasks.answers.score_answer``: 'addition' (the exact text), 'gsm8k' (the number), another name (number when the answer is one, else text); None: 'addition' for the generated data, else 'gsm8k'."""
    before: bool = True
    """Evaluate the starting model too (the 'before' figures)."""


class OfflineCheckpointConfig(Config):
    every_steps: int = Field(0, ge=0)
    """Checkpoint every this many steps, and at the last step (0: only the final model; no resume)."""
    keep_last: int = Field(2, ge=1)
    """Committed checkpoints kept."""


class OfflineConfig(Config):
    run: OfflineRunSection = OfflineRunSection()
    """Where the run lives, its seed, the console."""
    model: OfflineModelSection = OfflineModelSection()
    """Which model to train."""
    data: OfflineDataConfig
    """The training and held-out examples."""
    objective: ObjectiveConfig = ObjectiveConfig()
    """SFT or DPO, and DPO's settings."""
    training: OfflineTrainingConfig = OfflineTrainingConfig()
    """Steps, batch size, ranks."""
    learner: LearnerSection = LearnerSection()
    """The DeepSpeed trainer: ZeRO stage, precision, learning rate, schedule, micro batches, packing."""
    eval: OfflineEvalConfig = OfflineEvalConfig()
    """Held-out loss and greedy exact match."""
    checkpoint: OfflineCheckpointConfig = OfflineCheckpointConfig()
    """Checkpoints (resume, ``asyncrl export --step``)."""
    logging: LoggingConfig = LoggingConfig()
    """TensorBoard and W&B (``samples_*`` keys are not used offline)."""

    @model_validator(mode="after")
    def _check(self) -> OfflineConfig:
        trainer = self.learner.trainer
        if trainer.lr_schedule != "constant" and trainer.lr_decay_steps is not None:
            if trainer.lr_decay_steps > self.training.steps:
                raise ValueError(
                    f"learner.trainer.lr_decay_steps ({trainer.lr_decay_steps}) must be <= training.steps "
                    f"({self.training.steps}) (None: the whole run)"
                )
        if trainer.lr_warmup_steps > self.training.steps:
            raise ValueError(
                f"learner.trainer.lr_warmup_steps ({trainer.lr_warmup_steps}) must be <= training.steps "
                f"({self.training.steps})"
            )
        if self.training.batch_size < self.training.ranks:
            raise ValueError(
                f"training.batch_size ({self.training.batch_size}) must be >= training.ranks ({self.training.ranks}): "
                "every rank trains a share of each batch"
            )
        return self

    def trainer_config(self) -> TrainerConfig:
        """``learner.trainer`` with the schedule's length filled in: the run's steps (one update each)."""
        trainer = self.learner.trainer
        return trainer.model_copy(update={"lr_decay_steps": trainer.lr_decay_steps or self.training.steps})


def load_offline_config(
    recipe: str | Path | None, overrides: list[str] = (), kind: ObjectiveKind = "sft"
) -> OfflineConfig:
    """A recipe with dotted overrides; ``kind`` is the command's objective (``asyncrl sft`` or
    ``asyncrl dpo``), which a recipe may state but not contradict."""
    data = load_yaml(recipe) if recipe else {}
    data = apply_overrides(data, list(overrides))
    stated = (data.get("objective") or {}).get("kind")
    if stated is not None and stated != kind:
        raise UserValueError(
            f"objective.kind ({stated}) is not this command's ({kind}): run `asyncrl {stated}` for this recipe"
        )
    data.setdefault("objective", {})["kind"] = kind
    if "name" not in (data.get("run") or {}):
        data.setdefault("run", {})["name"] = kind
    return OfflineConfig(**data)


def dump_offline_config(cfg: OfflineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
