"""The dispatcher's settings (the run's ``dispatcher`` section)."""

from __future__ import annotations

from pydantic import Field

from asyncrl.configbase import Config


class DispatcherConfig(Config):
    epochs: int | None = None
    """Passes over the training prompts; None cycles forever (reshuffled each pass)."""
    lease_s: float = Field(600.0, gt=0)
    """Seconds a dispatched group may go unseen by the buffer before its prompt is dispatched
    again (a safety net: deaths the controller sees are acted on at once)."""
