"""A reward worker's settings (the run's ``reward`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncrl.configbase import Config
from asyncrl.rewards.registry import RewardSpec


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

    @field_validator("by_task")
    @classmethod
    def check_by_task(cls, value: dict[str, list[RewardSpec]]) -> dict[str, list[RewardSpec]]:
        empty = [name for name, specs in value.items() if not specs]
        if empty:
            raise ValueError(f"by_task {empty}: a task's rewards must hold at least one reward")
        return value

    def specs_by_task(self) -> dict[str | None, list[RewardSpec]]:
        """Every reward set: ``None`` -> ``rewards`` (the default), then each task's own."""
        return {None: self.rewards, **self.by_task}
