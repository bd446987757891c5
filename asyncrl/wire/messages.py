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

| kind | type | from -> to |
| --- | --- | --- |
| group | GroupMessage | generator -> reward worker -> buffer |
| want_prompts / prompts | WantPrompts / Prompts | generator <-> dispatcher |
| want_batch / batch | WantBatch / Batch | learner <-> buffer |
| buffer_status | BufferStatus | buffer -> dispatcher (PUB) |
| want_groups / groups | WantGroups / Groups | hot-plugged reward worker <-> the owner |
| want_run / run | WantRun / Run | a worker joining by address <-> the owner |
| want_ref_logprobs / ref_logprobs | WantRefLogprobs / RefLogprobs | learner <-> reference process |
| eval_request / eval_result | EvalRequest / EvalResult | controller -> generators -> controller |
| weights | WeightsAnnouncement | learner -> generators (PUB) |
| weights_ack / weights_error | WeightsAck / WeightsError | generator -> learner (shm transport) |
| weights_begin / weights_bucket / weights_end | WeightsBegin / WeightsBucket / WeightsEnd | learner -> generators (stream) |
| event | Event (ReadyEvent, StepEvent... by ``type``) | any process -> controller |
| control | Control (StopCommand, CheckpointCommand... by ``command``) | controller -> every process (PUB) |
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, ClassVar, NotRequired, TypedDict

import msgspec
import numpy as np

from asyncrl.wire.schema import SCHEMA_VERSION, Group, WireError, validate_group

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
"""Seconds to wait: finite and > 0 (NaN and inf fail both bounds): nothing waits forever."""


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


class Groups(Exchange, tag="groups"):
    """Unscored groups to score (possibly none)."""

    groups: list[Group] = []

    def check(self) -> None:
        _check_groups(self.groups)


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
    source: str = ""
    role: str = ""
    loop: str | None = None
    """The generator loop that answered, in a process of several (``asyncrl.generators.multiplex``)."""


# -- weights ---------------------------------------------------------------------------------------


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


# -- controller ------------------------------------------------------------------------------------


class Event(Message, kw_only=True, tag_field="type"):
    """Progress, reports and final counters of ``source`` (of ``role``): one type per ``type`` below,
    tagged by ``type`` inside the wire's ``kind`` ``event``. A generator loop of a process of
    several (``asyncrl.generators.multiplex``) names itself in ``loop``."""

    kind: str = "event"
    """The wire's kind (always ``event``; the event's own type is its ``type`` tag)."""
    source: str | None = None
    role: str | None = None
    loop: str | None = None

    @property
    def type(self) -> str:
        return type(self).__struct_config__.tag

    def as_map(self) -> dict:
        """The flat map it travels as, less ``kind``, ``schema`` and the optional fields left unset
        (None; a required field that is None, such as a step's ``accuracy``, stays): for the
        controller's records (``steps.jsonl``, final reports, the console)."""
        out = msgspec.to_builtins(self)
        unset = {
            f.encode_name for f in msgspec.structs.fields(self) if not f.required and out.get(f.encode_name) is None
        }
        return {k: v for k, v in out.items() if k not in ("kind", "schema") and k not in unset}


class ReadyEvent(Event, kw_only=True, tag="ready"):
    """The process is up and waits for ``go``; a generator says the version it serves."""

    version: int | None = None


class ErrorEvent(Event, kw_only=True, tag="error"):
    """The process failed with ``error`` and is exiting."""

    error: str


class CheckpointPartEvent(Event, kw_only=True, tag="checkpoint_part"):
    """The process wrote its ``part`` of the checkpoint of ``version``."""

    part: str
    version: int
    seconds: float | None = None


class RequeuedEvent(Event, kw_only=True, tag="requeued"):
    """The dispatcher answered the requeue command ``id``: ``groups`` of ``scope`` to dispatch again."""

    scope: str
    groups: int
    generator: str | None = None
    id: str | None = None


class StepEvent(Event, kw_only=True, tag="step"):
    """The learner's step that produced ``version``; the trainer's optional stats ride along."""

    version: int
    loss: float
    reward: float
    accuracy: float | None
    """None when no correctness reward scored the batch (``asyncrl.tasks.answers.batch_accuracy``)."""
    tokens: int
    samples: int
    wait_s: float
    step_s: float
    staleness_mean: float
    staleness_max: float
    clipfrac: float | None = None
    """Kept tokens whose ratio was cut at its ceiling or floor (the dual clip is ``clipfrac_dual``)."""
    clipfrac_high: float | None = None
    clipfrac_low: float | None = None
    clipfrac_dual: float | None = None
    ppo_kl: float | None = None
    """Mean of -log(pi_theta / anchor) over kept tokens (verl's and OpenRLHF's ``ppo_kl``)."""
    is_weight_mean: float | None = None
    is_weight_max: float | None = None
    is_weight_ess: float | None = None
    masked_frac: float | None = None
    behaviour_kl: float | None = None
    mismatch_kl: float | None = None
    entropy: float | None = None
    ref_kl: float | None = None
    kl_coef: float | None = None
    grad_norm: float | None = None
    grad_norm_max: float | None = None
    grad_clipped: float | None = None
    grad_clip_coef: float | None = None
    lr: float | None = None
    updates: int | None = None
    approx_kl: float | None = None
    clipfrac_by_epoch: list[float] | None = None
    approx_kl_by_epoch: list[float] | None = None
    value_loss: float | None = None
    truncated_frac: float | None = None
    overlong_penalty: float | None = None
    padding_frac: float | None = None
    outside_truncation_frac: float | None = None
    behaviour_ess: float | None = None
    """ESS of the raw importance weights pi_prox / mu over the batch's tokens, (Σw)² / (N·Σw²)."""
    behaviour_kl_by_staleness: dict[int, float] | None = None
    """Staleness -> mean k3 KL(mu ‖ pi_prox) per token of the samples that stale."""
    staleness_bound: int | None = None
    """Under ``buffer.max_staleness: auto``: the bound set after this step (for the batches to come)."""
    staleness_bound_reason: str | None = None
    """Under auto, on the steps that changed the bound: why (the signal and its limit)."""


class SampleText(msgspec.Struct, kw_only=True):
    """One trained answer as a person reads it (``SamplesEvent``): its text cut to
    ``logging.samples_max_chars``, its reward and where it came from."""

    uid: str
    group_id: str
    prompt_uid: str
    task: str
    prompt: str
    answer: str
    """The reference answer the rule rewards compare with."""
    completion: str
    reward: float | None
    reward_parts: dict[str, float] = {}
    """Reward name -> the value it gave (before weights)."""
    finish_reason: str
    tokens: int
    """Response tokens (the text may be cut; the tokens are counted whole)."""
    policy_version: int
    """The version of the answer's oldest token (its group's, or its first segment's)."""
    version_segments: list[list[int]] | None = None
    staleness: int
    """The learner's version before the step that trained it, minus ``policy_version``."""
    generator: str


class SamplesEvent(Event, kw_only=True, tag="samples"):
    """A share of the answers the learner step that produced ``version`` trained on, with their
    text, rewards and versions (``logging.samples_per_step`` groups, whole): the controller appends
    them to ``samples.jsonl`` and TensorBoard's text."""

    version: int
    samples: list[SampleText]


class DoneEvent(Event, kw_only=True, tag="done"):
    """The learner took its last step, reaching ``version``."""

    version: int


class BroadcastEvent(Event, kw_only=True, tag="broadcast"):
    """The learner published ``version`` over ``transport``, and what it cost."""

    version: int
    transport: str
    published_at: float
    """The learner's wall clock when it started publishing."""
    gather_s: float
    probe_s: float
    bytes: int
    buckets: int
    seconds: float
    extra_bytes: int | None = None
    """Peak bytes of buffers the transport held beside the weights (stream transport)."""


class ProbeStats(msgspec.Struct, kw_only=True):
    """One probe check of a weight update on a generator (``asyncrl.weights.probe.ProbeCheck``)."""

    mean_diff: float
    """mean_t |G_t − L_t| against the published version's logprobs."""
    max_diff: float
    """max_t |G_t − L_t|."""
    tol: float
    """The bound ``mean_diff`` was held to."""
    noise: float | None = None
    """The mismatch measured at identical weights (None: not calibrated yet)."""
    previous_diff: float | None = None
    """mean_t |G_t − L^prev_t| against the previous version's logprobs (None: not sent)."""
    separation: float | None = None
    """mean_t |L_t − L^prev_t|: how far apart the two versions are on the probe text."""
    tokens: int


class VersionEvent(Event, kw_only=True, tag="version"):
    """A generator now serves ``version``, and how long each stage of getting there took."""

    version: int
    apply_s: float
    load_s: float
    receive_s: float
    probe_s: float
    ready_at: float | None
    served_at: float
    """Wall clock, joined with the learner's ``published_at`` (``asyncrl.weights.timeline``)."""
    bytes: int
    probe_diff: float | None = None
    """The probe's mean |Δ| (``probe.mean_diff``)."""
    probe: ProbeStats | None = None
    """The probe check's statistics (None: no probe)."""


class HeartbeatEvent(Event, kw_only=True, tag="heartbeat"):
    """A process that joined by address is alive (every ``asyncrl.fleet.join.HEARTBEAT_S``): the
    controller, which did not start it and cannot see it die, takes its silence for a death."""


class FinalEvent(Event, kw_only=True, tag="final"):
    """A process's last counters, before it exits; each role sends its own (the controller's
    accounting, ``asyncrl.controller.accounting``, reconciles them)."""

    peak_rss_bytes: int | None = None
    """Peak RSS of the process and its live descendants."""
    rank: int | None = None
    """The learner's rank (``learner.ranks``): rank 0's report carries the learner's counts."""
    # shared by several roles
    version: int | None = None
    held: int | None = None
    dropped: dict[str, int] | None = None
    requeued: int | None = None
    rejected_frames: int | None = None
    busy_s: float | None = None
    wall_s: float | None = None
    # buffer
    inserted: int | None = None
    sampled: int | None = None
    resampled: int | None = None
    held_groups: int | None = None
    removed: dict[str, int] | None = None
    priority_updates_ignored: int | None = None
    zero_variance: dict | None = None
    """The zero-variance filter's counts (``ZeroVarianceFilter.report``), when it is on."""
    # dispatcher
    dispatched: int | None = None
    epoch: int | None = None
    index: int | None = None
    passed_over: int | None = None
    # generator
    generated: int | None = None
    tokens: int | None = None
    eval_prompts: int | None = None
    eval_s: float | None = None
    resumed: int | None = None
    """Answers aborted at a weight update and resumed under the new version (``generator.partial_rollouts: resume``)."""
    # learner
    trained: int | None = None
    trained_with_reuse: int | None = None
    staleness_hist: dict[str, int] | None = None
    token_staleness_hist: dict[str, int] | None = None
    """Response tokens trained, by staleness of the version that sampled each."""
    segments_hist: dict[str, int] | None = None
    """Samples trained, by the number of versions that sampled them (their ``version_segments``)."""
    stale_tokens_masked: int | None = None
    """Tokens kept as context only, past the staleness bound (``Sample.trained_from``)."""
    latency_s: dict[str, float] | None = None
    trained_tokens: int | None = None
    # reward worker
    received: int | None = None
    forwarded: int | None = None
    handed_out: int | None = None
    unscored: int | None = None
    # reference process
    served: int | None = None


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
        FinalEvent,
    )
}
"""Event type -> its declared type: every event a process may send."""


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


class StopCommand(Control, kw_only=True, tag="stop"):
    """Stop: finish what is in hand, send the final report, exit."""


class GoCommand(Control, kw_only=True, tag="go"):
    """Every process is ready: start working."""


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
    for cls in (StopCommand, GoCommand, RequeueCommand, CheckpointCommand, CheckpointCommittedCommand)
}
"""Command -> its declared type: every command the controller sends."""


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
