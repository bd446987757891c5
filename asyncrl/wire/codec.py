"""Messages <-> msgpack frames: ``encode`` a declared message, ``decode`` and validate a frame.

Decoding runs in this order, and the first failure names the reason (``WireError.reason``), which
every receiver counts and logs once:

1. ``oversized``: the frame is longer than the receiving socket's limit (checked before parsing);
2. ``malformed``: not msgpack, not a map, or nested too deeply (an envelope decode that reads
   only ``schema`` and ``kind``, ~2 µs for a 70 kB group: the other fields are skipped);
3. ``bad_schema``: ``schema`` is not ``SCHEMA_VERSION`` (an older one: the message says what
   changed, ``SCHEMA_CHANGES``); 4. ``bad_kind``: ``kind`` is unknown;
5. the kind's type (for ``event`` and ``control``, the variant its ``type`` or ``command`` tag
   names: an unknown one fails like a bad field): msgspec decodes the frame into it, checking every field's type and bounds
   (the type's ``reject_reason``, ``bad_fields`` unless it says otherwise; ``bad_array`` for an
   array map of an open message), then the type's ``check`` (``nonfinite_logprobs``...).

Arrays travel as ``__nd__`` maps (``asyncrl.wire.schema``), restored without a copy where a type
declares ``np.ndarray``. ``encode_map`` writes a raw map of any keys, for frames built by hand.
``upgrade`` rewrites a stored frame of an older schema (a buffer snapshot's groups) to this one.
"""

from __future__ import annotations

from typing import Any, Union

import msgpack
import msgspec
import numpy as np

from asyncrl.wire.messages import KINDS, TYPES, VARIANTS, Message
from asyncrl.wire.schema import (
    MOVED_FROM_META,
    SCHEMA_CHANGES,
    SCHEMA_VERSION,
    WireError,
    array_from_map,
    array_to_map,
    is_array_map,
    restore_arrays,
)


def _enc_hook(obj):
    try:
        return array_to_map(obj)
    except TypeError:
        raise NotImplementedError(f"cannot encode {type(obj).__name__} on the wire") from None


def _dec_hook(tp, obj):
    if tp is np.ndarray:
        if is_array_map(obj):
            return array_from_map(obj)
        raise TypeError(f"expected an array map, got {type(obj).__name__}")
    raise NotImplementedError(f"no decoder for {tp}")


class _Envelope(msgspec.Struct):
    schema: Any = None
    kind: Any = None


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_DECODERS = {
    kind: msgspec.msgpack.Decoder(Union[VARIANTS[kind]] if kind in VARIANTS else cls, dec_hook=_dec_hook)  # noqa: UP007
    for kind, cls in TYPES.items()
    if not cls.open
}


def encode(message: Message) -> bytes:
    """One message -> one msgpack frame."""
    if message.open:
        return encode_map(message.kind, message.as_dict())
    return _ENCODER.encode(message)


def encode_map(kind: str, body: dict) -> bytes:
    """A raw map of ``kind`` -> one frame, unvalidated (the receiver validates): for frames built by
    hand. ``body`` must not use the keys ``schema`` or ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"kind ({kind!r}) must be one of {KINDS}")
    return msgpack.packb({"schema": SCHEMA_VERSION, "kind": kind, **body}, default=array_to_map, use_bin_type=True)


def decode(frame: bytes, max_bytes: int | None = None) -> tuple[str, Message]:
    """One frame -> (kind, message). Raises ``WireError`` for anything that is not a valid message."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise WireError("oversized", f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        envelope = _ENVELOPE.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise WireError("malformed", f"{type(e).__name__}: {e}") from None
    if envelope.schema != SCHEMA_VERSION:
        why = SCHEMA_CHANGES.get(envelope.schema) if type(envelope.schema) is int else None
        raise WireError(
            "bad_schema", f"schema ({envelope.schema!r:.40}) must be {SCHEMA_VERSION}" + (f" ({why})" if why else "")
        )
    kind = envelope.kind
    cls = TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise WireError("bad_kind", f"kind ({kind!r:.40}) must be one of {KINDS}")
    try:
        message = _decode_open(cls, frame) if cls.open else _DECODERS[kind].decode(frame)
    except msgspec.ValidationError as e:
        raise WireError(cls.reject_reason, f"{kind}: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError("malformed", f"{kind}: {type(e).__name__}: {e}") from None
    message.check()
    return kind, message


def _decode_open(cls: type[Message], frame: bytes) -> Message:
    """Declared fields through the type's validation; the other keys, arrays restored, to ``extra``."""
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise WireError("malformed", f"{type(e).__name__}: {e}") from None
    body = restore_arrays(body)
    declared = {name: body.pop(name) for name in cls.__struct_fields__ if name in body and name != "extra"}
    declared["kind"] = body.pop("kind")
    message = msgspec.convert(declared, cls, dec_hook=_dec_hook)
    message.extra = body
    return message


def upgrade(frame: bytes) -> bytes:
    """A stored frame of schema 1 or 2 rewritten as this schema's: each group's ``sampled_at``,
    ``greedy_text``, ``greedy_reward``, ``unscored_reason`` and ``unscored_detail`` moved from its
    ``meta`` to their fields (schema 1); schema 3 only added optional fields, so a frame of schema
    2 is restamped. A frame of this schema (or one that is not a map of an older one) comes back
    as is, for ``decode`` to judge. For what this package wrote to disk (buffer snapshots);
    the sockets refuse older schemas."""
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:  # garbage is decode's to reject, with its reason
        return frame
    if type(body) is not dict or body.get("schema") not in (1, 2):
        return frame
    groups = [body.get("group")] + list(body.get("groups") or [])
    for group in groups:
        if type(group) is dict and type(group.get("meta")) is dict:
            for name in MOVED_FROM_META:
                if name in group["meta"]:
                    group[name] = group["meta"].pop(name)
    body["schema"] = SCHEMA_VERSION
    return msgpack.packb(body, use_bin_type=True)
