"""The kinds of reward a run can ask for, and how a config entry becomes a reward object.

``RewardSpec`` is one entry of ``reward.rewards``: a kind, a weight and the kind's options;
``build_reward`` builds the reward it names, importing only that kind's module (a rule reward
does not load aiohttp or transformers). The kinds implement the interface in
``asyncrl.rewards.base``, which in turn knows none of them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config
from asyncrl.rewards.base import Reward

RewardKind = Literal["exact_match", "format", "math_verify", "http_json", "openai_judge", "reward_model", "python"]


class RewardSpec(Config):
    """One reward of the run: its kind, weight and options (validated by the kind's options class)."""

    kind: RewardKind = "exact_match"
    """exact_match | format | math_verify (rules), http_json | openai_judge (HTTP), reward_model (HF),
    python (a function you write: ``options.function: module:function``)."""
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
        elif self.kind == "python":
            from asyncrl.rewards.function import PythonRewardConfig

            # The function is imported now; a file's path is kept absolute in the resolved config.
            self.options["function"] = PythonRewardConfig(**self.options).function
        return self

    @property
    def label(self) -> str:
        return self.name or self.kind


def build_reward(spec: RewardSpec, task_metadata: dict[str, dict] | None = None) -> Reward:
    """The reward object a spec describes (imports only what that kind needs). ``task_metadata``:
    each task's ``metadata`` by name, for the kinds that hand it on (``python``)."""
    if spec.kind in ("exact_match", "format", "math_verify"):
        from asyncrl.rewards import rules

        cls = {
            "exact_match": rules.ExactMatchReward,
            "format": rules.FormatReward,
            "math_verify": rules.MathVerifyReward,
        }
        return cls[spec.kind](spec.label, **spec.options)
    if spec.kind == "http_json":
        from asyncrl.rewards.judge import JsonScorerConfig, JsonScorerReward

        return JsonScorerReward(spec.label, JsonScorerConfig(**spec.options))
    if spec.kind == "openai_judge":
        from asyncrl.rewards.judge import JudgeConfig, OpenAIJudgeReward

        return OpenAIJudgeReward(spec.label, JudgeConfig(**spec.options))
    if spec.kind == "reward_model":
        from asyncrl.rewards.model import RewardModel, RewardModelConfig

        return RewardModel(spec.label, RewardModelConfig(**spec.options))
    if spec.kind == "python":
        from asyncrl.rewards.function import PythonReward, PythonRewardConfig

        return PythonReward(spec.label, PythonRewardConfig(**spec.options), task_metadata)
    raise ValueError(f"kind ({spec.kind!r}) must be one of {RewardKind.__args__}")
