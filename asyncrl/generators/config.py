"""A generator's settings (the run's ``generator`` section)."""

from __future__ import annotations

from pydantic import Field

from asyncrl.configbase import Config


class GeneratorConfig(Config):
    prompts_per_batch: int = Field(16, ge=1)
    """Prompts a generator asks for and samples in one engine call (each gives a group of n)."""
    request_timeout_s: float = Field(0.25, gt=0)
    """Seconds a request for prompts waits before it is asked again, with the version then served
    (short, because the dispatcher's admission is computed from the version in the request)."""
    greedy_baseline: bool = False
    """Also decode each prompt greedily and send that answer with its group (``meta['greedy_text']``),
    for ReMax's baseline; the reward worker scores it into ``meta['greedy_reward']``."""
    send_timeout_s: float = Field(30.0, gt=0)
    """Seconds a finished group waits for a reward worker to take it before the wait is reported."""
