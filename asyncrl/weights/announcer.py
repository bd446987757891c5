"""The newest version's announcement on a PUB socket, repeated every second.

A PUB socket drops everything sent before a subscriber joined (ZeroMQ's slow joiner), and a
generator may join, or restart, at any time. So each publisher that announces versions (file,
shm, nccl) keeps the newest announcement and sends it again from the learner's idle loop
(``announce``) at most once per ``every_s``: a late generator hears it within that time and the
others ignore a version they already serve. Sending is never blocking (PUB drops past its
high-water mark instead), so the repeats cost the learner nothing when nobody listens.

>>> announcer = VersionAnnouncer("tcp://127.0.0.1:0", name="learner.weights")
>>> announcer.set({"policy_version": 3, "path": "/runs/x/weights/v000003"})  # sent now
>>> announcer.announce()  # in the idle loop: sent again once a second has passed
>>> announcer.latest["policy_version"]
3
>>> announcer.close()
"""

from __future__ import annotations

import time

from asyncrl.wire.messages import WeightsAnnouncement
from asyncrl.wire.sockets import Publisher


class VersionAnnouncer:
    """Sends the newest ``weights`` announcement now, and again every ``every_s`` when asked."""

    def __init__(self, address: str, name: str, every_s: float = 1.0):
        if every_s <= 0:
            raise ValueError(f"every_s ({every_s}) must be > 0")
        self.pub = Publisher(address, name=name)
        self.address = self.pub.address
        self.every_s = every_s
        self.latest: dict | None = None
        """The newest announcement's body (None before the first version)."""
        self._last_sent = 0.0

    def set(self, body: dict) -> None:
        """Make ``body`` the newest announcement and send it now."""
        self.latest = body
        self.announce(force=True)

    def announce(self, force: bool = False) -> None:
        """Repeat the newest announcement (at most once per ``every_s`` unless forced)."""
        now = time.monotonic()
        if self.latest is not None and (force or now - self._last_sent > self.every_s):
            self.pub.send(WeightsAnnouncement.from_map(self.latest))
            self._last_sent = now

    def send_once(self, body: dict) -> None:
        """Send ``body`` once, not repeated (shm announces each bucket as it is written this way)."""
        self.pub.send(WeightsAnnouncement.from_map(body))

    def close(self) -> None:
        self.pub.close()
