"""Commands from the controller to the processes, over its PUB socket.

PUB drops what a subscriber is not connected for (a process still starting, or restarted), and
delivers to every subscriber of a role at once. So a command whose effect the controller must
see (a checkpoint part, a requeue) is kept and resent every ``RESEND_S`` until the answer
clears its key; handlers are idempotent (``asyncrl.fleet.context.ProcessContext.commands``).
"""

from __future__ import annotations

import time

import msgspec

from asyncrl.wire.messages import Control
from asyncrl.wire.sockets import Publisher

RESEND_S = 0.5
"""Seconds between resends of a command not yet answered."""


class CommandSender:
    """Sends commands and resends the unanswered ones; owns the table of those."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher
        self.unacked: dict[str, dict] = {}
        """Key -> the command and when it was last sent, until its answer clears the key."""

    def send(self, role: str, command: Control, ack: str | None = None) -> None:
        """Send ``command`` to a role; with ``ack``, resend it until ``acked(ack)``."""
        message = msgspec.structs.replace(command, roles=[role], id=ack or f"{command.command}@{time.monotonic()}")
        self.publisher.send(message)
        if ack is not None:
            self.unacked[ack] = {"body": message, "sent": time.monotonic()}

    def broadcast(self, command: Control, roles: list[str] | None = None) -> None:
        """Send ``command`` to ``roles`` (every role when None) once, unkept (``go`` and ``stop``
        are repeated by their senders' loops)."""
        self.publisher.send(msgspec.structs.replace(command, roles=roles))

    def acked(self, key: str | None) -> None:
        """The answer to ``key`` arrived: stop resending it."""
        self.unacked.pop(key, None)

    def resend(self) -> None:
        """Resend each command unanswered for ``RESEND_S``."""
        now = time.monotonic()
        for entry in self.unacked.values():
            if now - entry["sent"] > RESEND_S:
                self.publisher.send(entry["body"])
                entry["sent"] = now

    def forget(self) -> None:
        """Drop every unanswered command (the processes it was for are being replaced)."""
        self.unacked.clear()

    def close(self) -> None:
        self.publisher.close()
