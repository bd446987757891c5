"""The kinds of reward a run can ask for, and how a config entry becomes a reward object.

``RewardSpec`` is one entry of ``reward.rewards``: a kind, a weight and the kind's options;
``build_reward`` builds the reward it names, importing only that kind's module (a rule reward
does not load aiohttp or transformers). The kinds implement the interface in
``asyncrl.rewards.base``, which in turn knows none of them.
"""

from __future__ import annotations

from asyncrl.rewards.base import Reward
from asyncrl.rewards.config import RewardKind, RewardSpec


def build_reward(spec: RewardSpec, task_metadata: dict[str, dict] | None = None, budgets=None) -> Reward:
    """The reward object a spec describes (imports only what that kind needs). ``task_metadata``:
    each task's ``metadata`` by name, for the kinds that hand it on (``python``); ``budgets``: the
    process's ``asyncrl.rewards.budget.RateBudgets``, whose limiter an HTTP reward draws on (None:
    its own, the whole budget)."""
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

        cfg = JsonScorerConfig(**spec.options)
        return JsonScorerReward(spec.label, cfg, budgets.limiter(cfg) if budgets is not None else None)
    if spec.kind == "openai_judge":
        from asyncrl.rewards.judge import JudgeConfig, OpenAIJudgeReward

        cfg = JudgeConfig(**spec.options)
        return OpenAIJudgeReward(spec.label, cfg, budgets.limiter(cfg) if budgets is not None else None)
    if spec.kind == "reward_model":
        from asyncrl.rewards.model import RewardModel, RewardModelConfig

        return RewardModel(spec.label, RewardModelConfig(**spec.options))
    if spec.kind == "python":
        from asyncrl.rewards.function import PythonReward, PythonRewardConfig

        return PythonReward(spec.label, PythonRewardConfig(**spec.options), task_metadata)
    if spec.kind == "teacher":
        from asyncrl.rewards.teacher import TeacherConfig, TeacherReward

        return TeacherReward(spec.label, TeacherConfig(**spec.options))
    if spec.kind == "environment":
        from asyncrl.rewards.environment import EnvironmentReward

        return EnvironmentReward(spec.label, **spec.options)
    raise ValueError(f"kind ({spec.kind!r}) must be one of {RewardKind.__args__}")
