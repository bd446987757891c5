"""The controller's commands to the processes, one declared type per ``command`` tag (``COMMANDS``)."""

from __future__ import annotations

from asyncrl.wire.message_base import Control, NonNegative, NonNegativeFloat


class StopCommand(Control, kw_only=True, tag="stop"):
    """Stop: finish what is in hand, send the final report, exit."""


class GoCommand(Control, kw_only=True, tag="go"):
    """Every process is ready: start working.

    With ``hold_weights_s`` > 0 the generators keep serving the weights they started with (a
    publication waits in their subscription) until ``ReleaseWeightsCommand``, or for at most that
    many seconds: the held-out round before RL then runs beside the first learner steps and still
    scores the starting weights (``eval.overlap_before``)."""

    hold_weights_s: NonNegativeFloat = 0.0


class ReleaseWeightsCommand(Control, kw_only=True, tag="release_weights"):
    """The round ``round`` that the generators kept their starting weights for is over: apply
    publications again."""

    round: str


class RequeueCommand(Control, kw_only=True, tag="requeue"):
    """The dispatcher hands out again the groups of ``scope`` (of ``generator``) that were lost."""

    scope: str
    generator: str | None = None


class CheckpointCommand(Control, kw_only=True, tag="checkpoint"):
    """Write this role's part of the checkpoint of ``version`` into ``dir``."""

    dir: str
    version: NonNegative


class CheckpointCommittedCommand(Control, kw_only=True, tag="checkpoint_committed"):
    """The checkpoint of ``version`` is complete: state kept only until then may go."""

    version: NonNegative


COMMANDS: dict[str, type[Control]] = {
    cls.__struct_config__.tag: cls
    for cls in (
        StopCommand,
        GoCommand,
        ReleaseWeightsCommand,
        RequeueCommand,
        CheckpointCommand,
        CheckpointCommittedCommand,
    )
}
"""Command -> its declared type: every command the controller sends."""
