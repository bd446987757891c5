"""The wire: records and messages that cross process boundaries, their codec, and the sockets.

The public codec in one place: ``asyncrl.wire.decode(frame)`` -> (kind, message), ``encode(message)``,
``encode_map(kind, body)`` for frames built by hand, ``encode_group(group)``.
"""

from asyncrl.wire.codec import decode, encode, encode_map
from asyncrl.wire.messages import KINDS, GroupMessage
from asyncrl.wire.schema import SCHEMA_VERSION, Group, Sample, WireError, group_to_dict, validate_group


def encode_group(group: Group) -> bytes:
    """The frame of one ``group`` message."""
    return encode(GroupMessage(group=group))


__all__ = [
    "KINDS",
    "SCHEMA_VERSION",
    "Group",
    "Sample",
    "WireError",
    "decode",
    "encode",
    "encode_group",
    "encode_map",
    "group_to_dict",
    "validate_group",
]
