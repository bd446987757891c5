"""The weight publication's messages: announcements (file, shm, NCCL), a shm subscriber's
acknowledgements, and the stream transport's begin / bucket header / end (``asyncrl.weights``)."""

from __future__ import annotations

from typing import Any

from asyncrl.wire.message_base import Message, NonNegative, OpenMessage


class WeightsAnnouncement(OpenMessage, tag="weights"):
    """Weights of ``policy_version`` are ready: at ``path`` (file transport), in shared memory
    (``dir``, ``buckets``) or over NCCL (``store``, ``world_size``), with the publisher's
    ``probe``; or (shm) one bucket, ``part``, announced while the next ones are written. Keys
    it does not declare land in ``extra``."""

    policy_version: NonNegative
    transport: str | None = None
    path: str | None = None
    dir: str | None = None
    buckets: list[dict[str, Any]] | None = None
    ack: str | None = None
    store: str | None = None
    world_size: int | None = None
    probe: dict[str, Any] | None = None
    """The learner's probe of the version: a prompt, a continuation and its logprobs
    (``asyncrl.weights.probe``), checked by a generator after applying it."""
    part: NonNegative | None = None
    """The index of the one bucket an early (shm) announcement is about, in ``bucket``."""
    bucket: dict[str, Any] | None = None


class WeightsAck(Message, tag="weights_ack"):
    """A shm subscriber applied ``policy_version``: its memory may go."""

    subscriber: str
    policy_version: int
    error: str | None = None


class WeightsError(Message, tag="weights_error"):
    """A shm subscriber failed to apply ``policy_version``."""

    subscriber: str
    policy_version: int
    error: str | None = None


class WeightsBegin(OpenMessage, tag="weights_begin"):
    """A streamed version begins, with the publisher's ``probe`` (see ``WeightsAnnouncement``)."""

    policy_version: NonNegative
    probe: dict[str, Any] | None = None


class WeightsBucket(Message, tag="weights_bucket"):
    """The header of one streamed bucket: ``nbytes`` of raw frames follow."""

    policy_version: int
    index: int
    nbytes: NonNegative
    crc: int
    tensors: list[Any]
    hash: str = "crc32"


class WeightsEnd(Message, tag="weights_end"):
    """A streamed version ends after ``num_buckets`` buckets of ``bytes`` in all."""

    policy_version: int
    num_buckets: int
    bytes: int = 0
