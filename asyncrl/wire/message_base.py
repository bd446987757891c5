"""The bases of every message that crosses a socket: ``Message`` (tagged by ``kind``), ``Exchange``
(a request or reply paired by ``request_id``), ``OpenMessage`` (other keys kept in ``extra``), and
the bases of the two tagged unions inside a kind, ``Event`` (by ``type``) and ``Control`` (by
``command``). The declared messages are in ``asyncrl.wire.messages`` (and the modules it gathers:
``events``, ``finals``, ``commands``, ``weight_messages``).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, ClassVar

import msgspec

from asyncrl.wire.schema import SCHEMA_VERSION

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
"""Seconds to wait: finite and > 0 (NaN and inf fail both bounds): nothing waits forever."""
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
"""Finite and >= 0 (0 usually meaning: none)."""


class Message(msgspec.Struct, kw_only=True, tag_field="kind"):
    """Base of every message; ``schema`` is the wire protocol's version, checked before anything else.
    Fields are read as attributes."""

    schema: int = SCHEMA_VERSION
    reject_reason: ClassVar[str] = "bad_fields"
    """The reason a frame of this kind that fails validation is counted under."""
    open: ClassVar[bool] = False
    """Open messages keep the keys they do not declare in ``extra``."""

    @property
    def kind(self) -> str:
        return type(self).__struct_config__.tag

    def check(self) -> None:
        """Rules beyond field types, run after decoding; raises ``WireError``. Nothing by default."""


class Exchange(Message, kw_only=True):
    """A request or reply over DEALER/ROUTER: ``request_id`` pairs a reply with its request."""

    request_id: int | None = None


class OpenMessage(Message, kw_only=True):
    """A message whose other keys travel flat beside its declared fields and land in ``extra``."""

    open: ClassVar[bool] = True
    extra: dict[str, Any] = {}

    @classmethod
    def from_map(cls, body: dict):
        """The message of a flat map: its declared fields set, the other keys to ``extra`` (unvalidated)."""
        declared = set(cls.__struct_fields__) - {"schema", "extra"}
        return cls(
            **{k: v for k, v in body.items() if k in declared},
            extra={k: v for k, v in body.items() if k not in declared},
        )

    def as_dict(self) -> dict:
        """The flat map as it travels, less ``kind`` and ``schema``: declared fields that are set
        (not None) and ``extra``."""
        out = {
            name: value
            for name in self.__struct_fields__
            if name not in ("schema", "extra") and (value := getattr(self, name)) is not None
        }
        out.update(self.extra)
        return out

    def __eq__(self, other):
        """Equal to another message of its type with equal fields, or to the map it travels as."""
        if isinstance(other, dict):
            return self.as_dict() == other
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.__struct_fields__)

    __hash__ = None  # mutable, like the map it stands for


class Event(Message, kw_only=True, tag_field="type"):
    """Progress, reports and final counters of ``source`` (of ``role``): one type per ``type`` below,
    tagged by ``type`` inside the wire's ``kind`` ``event``. A generator loop of a process of
    several (``asyncrl.generators.multiplex``) names itself in ``loop``."""

    kind: str = "event"
    """The wire's kind (always ``event``; the event's own type is its ``type`` tag)."""
    source: str | None = None
    role: str | None = None
    loop: str | None = None
    final: ClassVar[bool] = False
    """True for the final reports (``asyncrl.wire.finals``)."""

    @property
    def type(self) -> str:
        return type(self).__struct_config__.tag


class Control(Message, kw_only=True, tag_field="command"):
    """A command to the processes of ``roles`` (every role when None), one type per ``command``
    below; ``id`` names it for its acknowledgement."""

    kind: str = "control"
    """The wire's kind (always ``control``; the command is its ``command`` tag)."""
    roles: list[str] | None = None
    id: str | None = None

    @property
    def command(self) -> str:
        return type(self).__struct_config__.tag
