"""The rewards' sections of the run's config: the reward worker (``reward``), each reward of a run
(``RewardSpec``) and which of them scores held-out evaluation (``eval_reward_spec``).

Declarations only: the root config (``asyncrl.config``) imports this module and nothing else of
the rewards, except the options class of a spec's kind (``RewardSpec.check_options``), which lives
beside that kind's code and is imported when a spec of that kind is read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config

RewardKind = Literal[
    "exact_match",
    "format",
    "math_verify",
    "http_json",
    "openai_judge",
    "reward_model",
    "python",
    "environment",
    "teacher",
]


class RewardSpec(Config):
    """One reward of the run: its kind, weight and options (validated by the kind's options class)."""

    kind: RewardKind = "exact_match"
    """exact_match | format | math_verify (rules), http_json | openai_judge (HTTP), reward_model (HF),
    python (a function you write: ``options.function: module:function``), environment (what a
    multi-turn episode's environment gave it: ``environment.cls``), teacher (a teacher model's
    per-token log-probabilities of each answer, for ``algorithm.distill``; no reward of its own)."""
    name: str | None = None
    """Name in metrics and ``Sample.reward_parts``; defaults to the kind."""
    weight: float = 1.0
    """Weight w_i of this reward in ``reward = Σ w_i r_i``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the kind, e.g. ``{url: ..., concurrency: 32}``; see the kind's ``...Config`` class."""

    @model_validator(mode="after")
    def check_options(self) -> RewardSpec:
        """Options of the HTTP and model kinds are checked when the config is read, not at first use."""
        if self.kind in ("http_json", "openai_judge"):
            from asyncrl.rewards.judge import JsonScorerConfig, JudgeConfig

            (JsonScorerConfig if self.kind == "http_json" else JudgeConfig)(**self.options)
        elif self.kind == "reward_model":
            from asyncrl.rewards.model import RewardModelConfig

            RewardModelConfig(**self.options)
        elif self.kind == "teacher":
            from asyncrl.rewards.teacher import TeacherConfig

            self.options["path"] = TeacherConfig(**self.options).path  # absolute in the resolved config
        elif self.kind == "python":
            from asyncrl.rewards.function import PythonRewardConfig

            # The function is imported now; a file's path is kept absolute in the resolved config.
            self.options["function"] = PythonRewardConfig(**self.options).function
        return self

    @property
    def label(self) -> str:
        return self.name or self.kind


class RewardConfig(Config):
    drain_s: float = Field(1.0, gt=0)
    """On stop, seconds of silence on the input after which the worker has drained and exits."""
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(kind="exact_match")])
    """The rewards and their weights: reward = Σ weight_i · reward_i (see ``rewards.base``; kinds in ``rewards.registry``)."""
    by_task: dict[str, list[RewardSpec]] = Field(default_factory=dict)
    """Rewards of the prompts of one task (a source of ``task.sources``), by its name, instead of
    ``rewards``; a task not named here is scored by ``rewards``."""
    concurrency: int = Field(64, ge=1)
    """Groups scored at once by one worker."""
    queue_groups: int = Field(256, ge=1)
    """Groups taken in and waiting to be scored at most; past it the worker stops reading its input."""
    on_failure: Literal["drop", "requeue"] = "drop"
    """A group left unscored: forward it unscored (the buffer drops it, counted) or score it again later."""
    max_requeues: int = Field(3, ge=0)
    """With on_failure=requeue: times a group is scored again before it is forwarded unscored (the HTTP
    rewards re-request only the samples they have not scored yet)."""
    requeue_delay_s: float = Field(2.0, ge=0)
    """With on_failure=requeue: seconds before a group is scored again, ±50 % at random (groups that failed together return spread out)."""
    request_timeout_s: float = Field(5.0, gt=0)
    """A hot-plugged worker's wait for the owner's reply to a request for work."""
    lease_timeout_s: float = Field(2.0, gt=0.2, le=60)
    """The HTTP rewards' rate budgets are shared by every worker of the run (``rewards.budget``):
    a hot-plugged worker unheard for this long (a live one asks at least every 0.1 s) is taken as
    gone and its share goes back to the others; a worker whose lease from the owner is not renewed
    for this long falls back to ``unleased_share``."""
    unleased_share: float = Field(0.125, gt=0, le=1)
    """Fraction of each rate budget a hot-plugged worker uses before its first lease from the owner
    and when its lease runs out (1/8: safe with up to 8 workers leaderless at once)."""

    @field_validator("by_task")
    @classmethod
    def check_by_task(cls, value: dict[str, list[RewardSpec]]) -> dict[str, list[RewardSpec]]:
        empty = [name for name, specs in value.items() if not specs]
        if empty:
            raise ValueError(f"by_task {empty}: a task's rewards must hold at least one reward")
        return value

    @model_validator(mode="after")
    def check_shared_budgets(self) -> RewardConfig:
        """HTTP rewards calling one host with one ``api_key_env`` share one budget: they must state it alike."""
        from asyncrl.rewards.judge import check_shared_budgets

        check_shared_budgets(self.specs_by_task().values())
        return self

    def specs_by_task(self) -> dict[str | None, list[RewardSpec]]:
        """Every reward set: ``None`` -> ``rewards`` (the default), then each task's own."""
        return {None: self.rewards, **self.by_task}


IN_PROCESS = ("exact_match", "format", "math_verify", "python", "environment")
"""Reward kinds evaluation may score with (``asyncrl.rewards.evaluation`` says why not the others)."""
COMPARES_ANSWER = ("exact_match", "math_verify")
"""Kinds that compare with the reference answer: a prompt without one is not scored by them."""


def eval_reward_spec(reward_cfg, eval_cfg, task: str) -> RewardSpec:
    """The reward that decides whether ``task``'s answers are correct (``reward_cfg``: the run's
    ``RewardConfig``; ``eval_cfg``: its ``EvalConfig``); a ValueError names what is wrong."""
    specs = reward_cfg.by_task.get(task, reward_cfg.rewards)
    labels = [s.label for s in specs]
    wanted = eval_cfg.reward_by_task.get(task, eval_cfg.reward)
    if wanted is not None:
        spec = next((s for s in specs if s.label == wanted), None)
        if spec is None:
            raise ValueError(f"eval.reward ({wanted!r}) must name one of task {task!r}'s rewards: {labels}")
    else:
        spec = next((s for s in specs if s.kind in COMPARES_ANSWER), None)
        spec = spec or next((s for s in specs if s.kind == "python"), None)
        spec = spec or next((s for s in specs if s.kind == "environment"), None)
        # Rewards of other kinds only (a judge, a reward model): the task's exact match, as before.
        spec = spec or RewardSpec(kind="exact_match")
    if spec.kind not in IN_PROCESS:
        raise ValueError(
            f"eval.reward ({spec.label!r}) is of kind {spec.kind}: evaluation is scored in the controller "
            f"by the kinds {IN_PROCESS} only; name one of those"
        )
    return spec


def eval_reward_specs(cfg) -> dict[str, RewardSpec]:
    """Each task's evaluation reward (``cfg``: the run's ``RunConfig``), checked."""
    tasks = cfg.task.task_names()
    unknown = [name for name in cfg.eval.reward_by_task if name not in tasks]
    if unknown:
        raise ValueError(f"eval.reward_by_task {unknown} must name tasks of this run: {tasks}")
    return {task: eval_reward_spec(cfg.reward, cfg.eval, task) for task in tasks}
