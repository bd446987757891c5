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
    requeue_grace_s: float = Field(10.0, ge=0)
    """Seconds the groups not yet in the buffer get to turn up there after a reward worker or the
    buffer died, before they are dispatched again: most were still being sampled upstream and
    reach the restarted process (a copy sent at once is sampled twice and one of the two dropped).
    Longer than a restart plus the sampling of a group; 0 sends them out again at once."""
    ahead_versions: int | None = Field(None, ge=0)
    """Versions of groups dispatched ahead of the generators' (the admission rule's s in
    ``asyncrl.dispatcher.admission``); None: ``buffer.max_staleness``, which it may not exceed.
    Smaller, a prioritized buffer has fewer groups to pass over until they turn stale."""
