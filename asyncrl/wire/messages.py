"""Every message that crosses a socket, as a declared type: the control plane's requests, replies and events.

A message is a ``msgspec.Struct`` tagged by its ``kind``; on the wire it is the msgpack map of its
fields plus ``kind`` and ``schema`` (``asyncrl.wire.codec`` encodes and decodes). Receiving is
validating: a field of the wrong type, a missing required field or a value outside its declared
bounds rejects the frame with the type's ``reject_reason`` (``bad_fields`` unless it says
otherwise), and ``check`` adds what a type cannot say (non-finite numbers, array shapes). Fields
with defaults are optional on the wire (older senders omit them); keys a type does not declare are
ignored, except by *open* messages (the weight announcements), whose other keys travel beside the
declared ones and are kept in ``extra``. Events and commands are tagged unions inside their kind:
``type`` says which event (``EVENTS``), ``command`` which command (``COMMANDS``), and each is
declared with its own fields.

Constructing a message does not validate it (msgspec checks on decode): a sender may build any
message, and the receiver judges it. The records inside messages (``Group``, ``Sample``) are the
data plane's, declared in ``asyncrl.wire.schema``.

This module declares the requests and replies and gathers the rest, so every message imports from
here: the bases (``asyncrl.wire.message_base``), the events (``asyncrl.wire.events``), the final
reports (``asyncrl.wire.finals``), the commands (``asyncrl.wire.commands``) and the weight
publication's messages (``asyncrl.wire.weight_messages``).

| kind | type | from -> to |
| --- | --- | --- |
| group | GroupMessage | generator -> reward worker -> buffer |
| want_prompts / prompts | WantPrompts / Prompts | generator <-> dispatcher |
| want_batch / batch | WantBatch / Batch | learner <-> buffer |
| buffer_status | BufferStatus | buffer -> dispatcher (PUB) |
| want_groups / groups | WantGroups / Groups | hot-plugged reward worker <-> the owner |
| want_run / run | WantRun / Run | a worker joining by address <-> the owner |
| rate_lease | RateLease | the owner -> a hot-plugged reward worker |
| want_ref_logprobs / ref_logprobs | WantRefLogprobs / RefLogprobs | learner <-> reference process |
| eval_request / eval_result | EvalRequest / EvalResult | controller -> generators -> controller |
| weights | WeightsAnnouncement | learner -> generators (PUB) |
| weights_ack / weights_error | WeightsAck / WeightsError | generator -> learner (shm transport) |
| weights_begin / weights_bucket / weights_end | WeightsBegin / WeightsBucket / WeightsEnd | learner -> generators (stream) |
| event | Event (ReadyEvent, StepEvent... and each role's final report, BufferFinal... by ``type``) | any process -> controller |
| control | Control (StopCommand, CheckpointCommand... by ``command``) | controller -> every process (PUB) |
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, NotRequired, TypedDict

import msgspec
import numpy as np

from asyncrl.wire.commands import (
    COMMANDS,
    CheckpointCommand,
    CheckpointCommittedCommand,
    GoCommand,
    ReleaseWeightsCommand,
    RequeueCommand,
    StopCommand,
)
from asyncrl.wire.events import (
    BroadcastEvent,
    CheckpointPartEvent,
    DoneEvent,
    ErrorEvent,
    HeartbeatEvent,
    ProbeStats,
    ReadyEvent,
    RequeuedEvent,
    SamplesEvent,
    SampleText,
    StepEvent,
    VersionEvent,
)
from asyncrl.wire.finals import (
    FINALS,
    BufferFinal,
    DispatcherFinal,
    FinalReport,
    GeneratorFinal,
    LearnerFinal,
    ReferenceFinal,
    RewardFinal,
)
from asyncrl.wire.message_base import (
    Control,
    Event,
    Exchange,
    Message,
    NonNegative,
    OpenMessage,
    PositiveSeconds,
)
from asyncrl.wire.schema import Group, WireError, validate_group
from asyncrl.wire.weight_messages import (
    WeightsAck,
    WeightsAnnouncement,
    WeightsBegin,
    WeightsBucket,
    WeightsEnd,
    WeightsError,
)


def _check_groups(groups: list[Group]) -> None:
    for g in groups:
        validate_group(g)


# -- the data plane -------------------------------------------------------------------------------


class GroupMessage(Message, tag="group"):
    """A scored or unscored group of samples: generator -> reward worker -> buffer."""

    group: Group

    def check(self) -> None:
        validate_group(self.group)


# -- generator <-> dispatcher --------------------------------------------------------------------


class PromptRow(TypedDict):
    """One prompt handed out: a plain map (it is kept as is in the dispatcher's checkpoint)."""

    group_id: str
    prompt_uid: str
    text: str
    answer: str
    task: str
    columns: NotRequired[dict[str, Any]]
    """The dataset row's columns (JSON values), passed on in the group for the rewards; absent: none."""


class WantPrompts(Exchange, tag="want_prompts"):
    """Room for up to ``max_prompts`` more prompts, to be sampled by ``policy_version``."""

    generator: str
    max_prompts: int = 1
    """Taken as at least 1."""
    policy_version: NonNegative | None = None
    """The version the generator serves; None: the learner's."""
    timeout_s: PositiveSeconds = 1.0
    """How long the generator waits for the reply: the dispatcher answers only before then."""
    dropped: list[str] = []
    """Ids of groups the generator dropped (their reason is in its ledger): settled, their slots freed."""


class Prompts(Exchange, tag="prompts"):
    """Prompt rows to sample; empty with ``learner_version``: load newer weights and ask again."""

    prompts: list[PromptRow] = []
    learner_version: int | None = None


# -- learner <-> buffer --------------------------------------------------------------------------


class PriorityUpdates(msgspec.Struct):
    """New priorities for groups of earlier batches, by buffer key (keys of groups gone are ignored)."""

    group_keys: list[int] = []
    priorities: list[float] = []
    """One per key, finite and >= 0 (checked by the buffer: a bad update is rejected, the request served)."""


class TrainedGroups(msgspec.Struct):
    """The groups the learner's last step trained, passed on to the dispatcher in ``buffer_status``."""

    group_ids: list[str]
    version: int | None = None
    """The learner version of that step; None: the request's ``policy_version``."""


class WantBatch(Exchange, tag="want_batch"):
    """The next batch of ``num_groups`` groups at ``policy_version``, waiting at most ``timeout_s``."""

    reject_reason: ClassVar[str] = "bad_request"
    num_groups: Annotated[int, msgspec.Meta(ge=1)] = 1
    policy_version: NonNegative = 0
    timeout_s: PositiveSeconds = 5.0
    priority_updates: PriorityUpdates | None = None
    trained: TrainedGroups | None = None
    max_staleness: NonNegative | None = None
    """The staleness bound the learner set (``buffer.max_staleness: auto``), for the buffer's gate
    and, through ``buffer_status``, the dispatcher's admission; None: the configured one."""


class Batch(Exchange, tag="batch"):
    """``groups`` (empty after a timeout) with, per group, its buffer key, P(i), importance weight
    and whether the buffer handed this copy out before."""

    groups: list[Group] = []
    group_keys: list[int] = []
    probabilities: list[float] = []
    is_weights: list[float] = []
    repeat: list[bool] = []
    """Per group, True when the buffer handed out this very copy before (``buffer.max_times_sampled
    != 1``); empty: every group's first hand-out."""

    def check(self) -> None:
        _check_groups(self.groups)
        if self.repeat and len(self.repeat) != len(self.groups):
            raise WireError("bad_fields", f"{len(self.repeat)} repeat flags for {len(self.groups)} groups")


class BufferStatus(Message, tag="buffer_status"):
    """The learner's version and what became of groups since the last status (for admission)."""

    learner_version: NonNegative
    dropped_groups: int = 0
    """Groups the buffer dropped since it started (or since its snapshot's count)."""
    held_groups: int = 0
    inserted: list[str] = []
    dropped: list[str] = []
    trained: list[tuple[int, list[str]]] = []
    """[learner version, group ids] per step reported trained."""
    max_staleness: NonNegative | None = None
    """The staleness bound the learner last set (its gate applies it); None: none set, the configured one."""


# -- reward workers -------------------------------------------------------------------------------


class WantGroups(Exchange, tag="want_groups"):
    """A hot-plugged worker asks its owner for up to ``max_groups`` groups; says what it holds."""

    max_groups: int = 1
    holding: int = 0
    """Samples the worker holds (a heartbeat: the owner waits for busy peers before it drains)."""
    leaving: bool = False
    worker: str = ""
    budgets: list[str] = []
    """Ids of the shared rate budgets the worker's rewards call (``asyncrl.rewards.budget.budget_id``:
    a hash of the API key's variable name and the host, never a secret); the owner leases it a share of each."""


class Groups(Exchange, tag="groups"):
    """Unscored groups to score (possibly none)."""

    groups: list[Group] = []

    def check(self) -> None:
        _check_groups(self.groups)


class RateShare(msgspec.Struct, kw_only=True):
    """One worker's share of one shared rate budget (``asyncrl.rewards.budget``)."""

    budget: str
    """The budget's id (``budget_id``: a hash, never the key)."""
    concurrency: Annotated[int, msgspec.Meta(ge=1)]
    """Requests in flight at most."""
    rpm: Annotated[float, msgspec.Meta(gt=0, le=1e12)] | None = None
    """Requests per minute at most; None: unlimited."""
    tpm: Annotated[float, msgspec.Meta(gt=0, le=1e15)] | None = None
    """Tokens per minute at most; None: unlimited."""


class RateLease(Exchange, tag="rate_lease"):
    """The owner leases a hot-plugged reward worker its share of each shared rate budget, sent when
    the set of live workers changes and renewed every quarter of ``reward.lease_timeout_s``; a
    worker whose lease is not renewed within ``reward.lease_timeout_s`` falls back to
    ``reward.unleased_share``."""

    shares: list[RateShare] = []
    workers: NonNegative = 1
    """Live workers the budgets were divided among (the owner included)."""


class WantRun(Exchange, tag="want_run"):
    """A worker joining by address asks what the run is."""


class Run(Exchange, tag="run"):
    """The run's resolved config and its socket addresses, as JSON-able maps."""

    config: dict[str, Any]
    endpoints: dict[str, Any]


# -- learner <-> reference process ----------------------------------------------------------------


class WantRefLogprobs(Exchange, tag="want_ref_logprobs"):
    """Reference logprobs of a micro batch: (B, L) ids and mask, (B, L-1) positions to score."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    score_mask: np.ndarray
    temperature: float
    top_k: int
    top_p: float
    position_ids: np.ndarray | None = None
    """(B, L) with packed rows (several sequences to a row, ``asyncrl.learner.packing``): each
    sequence's positions from 0, attention kept within each; the mask is then ignored. None:
    one right-padded sequence per row, positions from the mask."""

    def check(self) -> None:
        shape = np.shape(self.input_ids)
        if self.position_ids is not None and np.shape(self.position_ids) != shape:
            raise WireError("bad_fields", f"position_ids shape {np.shape(self.position_ids)} is not input_ids' {shape}")


class RefLogprobs(Exchange, tag="ref_logprobs"):
    """(B, L-1) float32: the reference's logprob of each scored next token, 0 elsewhere."""

    logprobs: np.ndarray


# -- held-out evaluation ---------------------------------------------------------------------------


class EvalRequest(Message, tag="eval_request"):
    """Answer ``prompts`` greedily, and ``samples_k`` times sampled, at most ``max_new_tokens``
    each (``asyncrl.tasks.heldout``)."""

    round: str
    chunk: int
    version: int
    """The learner version the request was asked at."""
    prompts: list[str]
    max_new_tokens: int
    sent_at: float
    """The controller's wall clock when it asked."""
    samples_k: int = 0
    """Answers sampled per prompt beside the greedy one (0: greedy only)."""
    temperature: float = 1.0
    """Temperature of the sampled answers."""
    top_p: float = 1.0
    """Nucleus mass of the sampled answers."""
    seeds: list[int] = []
    """One seed per prompt for its sampled answers (empty when ``samples_k`` is 0)."""
    rows: list[dict[str, Any]] = []
    """With an environment (``environment.cls``): each prompt's row (``answer``, ``columns``,
    ``prompt_uid``, ``task``), which the environment resets from; empty otherwise."""


class EvalResult(Message, tag="eval_result"):
    """The greedy ``texts`` (in prompt order) for ``round``/``chunk``, by ``generator`` serving
    ``version``, with their finish reasons, and each prompt's ``samples_k`` sampled answers."""

    round: str
    chunk: int
    generator: str
    version: int
    texts: list[str]
    seconds: float
    """Seconds of decoding."""
    queued_s: float
    """Seconds from ``sent_at`` to the start of decoding."""
    finish_reasons: list[str] = []
    """Why each greedy answer ended: ``stop`` (EOS, a stop string or token), ``length``, ``error``."""
    samples: list[list[str]] = []
    """Each prompt's sampled answers (empty when none were asked)."""
    sample_finish_reasons: list[list[str]] = []
    """Why each sampled answer ended."""
    env_rewards: list[list[float | None]] = []
    """With an environment: each prompt's episodes' environment rewards, greedy first (None:
    the environment failed); empty otherwise."""
    env_errors: list[list[str | None]] = []
    """Why each of those episodes' environment failed (None: it did not)."""
    turns: list[list[int]] = []
    """With an environment: each of those episodes' model turns, greedy first; empty otherwise
    (and from a generator that predates them: the round then reports no episode figures)."""
    tool_calls: list[list[int]] = []
    """Each of those episodes' tool calls."""
    tool_errors: list[list[int]] = []
    """Each of those episodes' tool calls that ended in an error observation."""
    source: str = ""
    role: str = ""
    loop: str | None = None
    """The generator loop that answered, in a process of several (``asyncrl.generators.multiplex``)."""


EVENTS: dict[str, type[Event]] = {
    cls.__struct_config__.tag: cls
    for cls in (
        ReadyEvent,
        ErrorEvent,
        CheckpointPartEvent,
        RequeuedEvent,
        StepEvent,
        SamplesEvent,
        DoneEvent,
        BroadcastEvent,
        VersionEvent,
        HeartbeatEvent,
        *FINALS.values(),
    )
}
"""Event type -> its declared type: every event a process may send."""


TYPES: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls
    for cls in (
        GroupMessage,
        WantPrompts,
        Prompts,
        WantBatch,
        Batch,
        BufferStatus,
        WantGroups,
        Groups,
        RateLease,
        WantRun,
        Run,
        WantRefLogprobs,
        RefLogprobs,
        EvalRequest,
        EvalResult,
        WeightsAnnouncement,
        WeightsAck,
        WeightsError,
        WeightsBegin,
        WeightsBucket,
        WeightsEnd,
    )
} | {"event": Event, "control": Control}
"""kind -> its type: every kind the wire knows (``event`` and ``control``: the base of their
tagged unions, ``EVENTS`` and ``COMMANDS``)."""
VARIANTS: dict[str, tuple[type[Message], ...]] = {"event": tuple(EVENTS.values()), "control": tuple(COMMANDS.values())}
"""The kinds that are tagged unions: kind -> its variants, one of which a frame of it decodes to."""
KINDS = tuple(TYPES)

__all__ = [
    "COMMANDS",
    "EVENTS",
    "KINDS",
    "TYPES",
    "VARIANTS",
    "Batch",
    "BroadcastEvent",
    "BufferStatus",
    "CheckpointCommand",
    "CheckpointCommittedCommand",
    "CheckpointPartEvent",
    "Control",
    "DoneEvent",
    "ErrorEvent",
    "EvalRequest",
    "EvalResult",
    "Event",
    "Exchange",
    "FINALS",
    "BufferFinal",
    "DispatcherFinal",
    "FinalReport",
    "GeneratorFinal",
    "LearnerFinal",
    "ReferenceFinal",
    "RewardFinal",
    "GoCommand",
    "GroupMessage",
    "Groups",
    "HeartbeatEvent",
    "Message",
    "NonNegative",
    "OpenMessage",
    "PositiveSeconds",
    "PriorityUpdates",
    "ReleaseWeightsCommand",
    "ProbeStats",
    "PromptRow",
    "Prompts",
    "RateLease",
    "RateShare",
    "ReadyEvent",
    "RefLogprobs",
    "RequeueCommand",
    "RequeuedEvent",
    "Run",
    "SampleText",
    "SamplesEvent",
    "StepEvent",
    "StopCommand",
    "TrainedGroups",
    "VersionEvent",
    "WantBatch",
    "WantGroups",
    "WantPrompts",
    "WantRefLogprobs",
    "WantRun",
    "WeightsAck",
    "WeightsAnnouncement",
    "WeightsBegin",
    "WeightsBucket",
    "WeightsEnd",
    "WeightsError",
]
