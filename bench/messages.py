"""Typed messages: encode + decode + validate of the hot messages, by three ways of declaring them.

The control plane's hot messages, at the sizes a run sends them:

- ``group``: one group of ``--n`` samples of ``--tokens`` response tokens (int32 ids, float32
  logprobs) and a 256-token prompt, as a generator sends it to a reward worker and the buffer;
- ``want_prompts`` + ``prompts``: a generator's request for 16 prompts and the dispatcher's reply;
- ``batch``: the buffer's reply to a learner, ``--batch-groups`` such groups with their keys,
  probabilities and importance weights.

Each is measured four ways, round trip (encode, decode, validate), in one process, interleaved
over ``--repeats`` rounds (the median is reported; the machine is shared):

- ``dicts``: the hand-written way this package used before typed messages: msgpack maps, records
  rebuilt by hand from the group maps, fields checked with ``isinstance`` and ``int()``;
- ``msgspec_dataclass``: ``asyncrl.wire.codec``: msgspec Structs for messages, the records kept as
  dataclasses (``asyncrl.wire.schema``), decoded and type-checked by msgspec;
- ``msgspec_struct``: the same with the records declared as ``msgspec.Struct`` too;
- ``pydantic``: pydantic v2 models (``model_validate`` of the unpacked map, ``model_dump`` to pack).

Every way ends with the same semantic checks (``validate_group``: finite logprobs, shapes). Prints
one JSON object: µs per round trip of each message and way, and the ratio to ``dicts``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/messages.py [--tokens 1024] [--n 8] [--batch-groups 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import pydantic  # noqa: E402

from asyncrl.wire import codec  # noqa: E402
from asyncrl.wire.messages import Batch, GroupMessage, Prompts, WantPrompts  # noqa: E402
from asyncrl.wire.schema import (  # noqa: E402
    Group,
    Sample,
    array_from_map,
    array_to_map,
    group_to_dict,
    validate_group,
)

ROWS = [
    {"group_id": f"g{i:08d}", "prompt_uid": f"p{i}", "text": "12+34=" * 8, "answer": "46", "task": "addition"}
    for i in range(16)
]


def make_group(index: int, n: int, tokens: int) -> Group:
    rng = np.random.default_rng(index)
    samples = [
        Sample(
            uid=f"g{index}/{i}",
            response_ids=rng.integers(0, 32000, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32),
            text="x" * 64,
            finish_reason="stop",
            reward=1.0,
            reward_parts={"exact_match": 1.0},
            reward_seconds={"exact_match": 1e-5},
        )
        for i in range(n)
    ]
    return Group(
        group_id=f"g{index}",
        prompt_uid="p",
        task="addition",
        prompt="12+34=",
        answer="46",
        prompt_ids=np.arange(256, dtype=np.int32),
        policy_version=3,
        generator="generator-0",
        samples=samples,
        sampled_at=1.0,
    )


# -- dicts: the hand-checked maps typed messages replaced ---------------------------------------------


def _pack(kind: str, body: dict) -> bytes:
    return msgpack.packb({"schema": 1, "kind": kind, **body}, default=array_to_map, use_bin_type=True)


def _unpack(frame: bytes) -> dict:
    msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    if not isinstance(msg, dict) or msg.pop("schema", None) != 1:
        raise ValueError("bad_schema")
    return msg


def _group_from_map(d: dict) -> Group:
    samples = []
    for s in d["samples"]:
        if not isinstance(s, dict):
            raise ValueError("bad_fields")
        s = dict(s)
        for name in ("response_ids", "logprobs", "token_rewards"):
            if type(s.get(name)) is dict:
                s[name] = array_from_map(s[name])
        samples.append(Sample(**s))
    g = Group(**{**d, "prompt_ids": array_from_map(d["prompt_ids"]), "samples": samples})
    validate_group(g)
    return g


def dicts_group(g: Group) -> Group:
    return _group_from_map(_unpack(_pack("group", {"group": group_to_dict(g)}))["group"])


def dicts_prompts() -> tuple:
    body = _unpack(_pack("want_prompts", {"generator": "generator-0", "max_prompts": 16, "policy_version": 3}))
    request = (
        str(body.get("generator")),
        max(1, int(body.get("max_prompts", 1))),
        int(body.get("policy_version", 0)),
        float(body.get("timeout_s", 1.0)),
    )
    reply = _unpack(_pack("prompts", {"prompts": ROWS, "request_id": 1}))
    rows = reply["prompts"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("bad_fields")
    return request, rows


def dicts_batch(groups: list[Group]) -> list[Group]:
    body = {
        "groups": [group_to_dict(g) for g in groups],
        "group_keys": list(range(len(groups))),
        "probabilities": [0.1] * len(groups),
        "is_weights": [1.0] * len(groups),
    }
    msg = _unpack(_pack("batch", body))
    return [_group_from_map(d) for d in msg["groups"]]


# -- msgspec with dataclass records: asyncrl.wire.codec ------------------------------------------------


def codec_group(g: Group) -> Group:
    return codec.decode(codec.encode(GroupMessage(group=g)))[1].group


def codec_prompts() -> tuple:
    request = codec.decode(codec.encode(WantPrompts(generator="generator-0", max_prompts=16, policy_version=3)))[1]
    reply = codec.decode(codec.encode(Prompts(prompts=ROWS, request_id=1)))[1]
    return request, reply.prompts


def codec_batch(groups: list[Group]) -> list[Group]:
    n = len(groups)
    batch = Batch(groups=groups, group_keys=list(range(n)), probabilities=[0.1] * n, is_weights=[1.0] * n)
    return codec.decode(codec.encode(batch))[1].groups


# -- msgspec with Struct records ------------------------------------------------------------------------


class SSample(msgspec.Struct):
    uid: str
    response_ids: np.ndarray
    logprobs: np.ndarray
    text: str
    finish_reason: str
    reward: float | None = None
    token_rewards: np.ndarray | None = None
    reward_parts: dict[str, float] = {}
    reward_seconds: dict[str, float] = {}
    version_segments: list[list[int]] | None = None


class SGroup(msgspec.Struct):
    group_id: str
    prompt_uid: str
    task: str
    prompt: str
    answer: str
    prompt_ids: np.ndarray
    policy_version: Annotated[int, msgspec.Meta(ge=0)]
    generator: str
    samples: list[SSample]
    rollout_s: float = 0.0
    reward_s: float = 0.0
    meta: dict[str, Any] = {}


class SGroupMessage(msgspec.Struct, tag="group", tag_field="kind"):
    group: SGroup
    schema: int = 1


class SBatch(msgspec.Struct, tag="batch", tag_field="kind"):
    groups: list[SGroup] = []
    group_keys: list[int] = []
    probabilities: list[float] = []
    is_weights: list[float] = []
    request_id: int | None = None
    schema: int = 1


def _struct_group(g: Group) -> SGroup:
    samples = [SSample(**{f: getattr(s, f) for f in SSample.__struct_fields__}) for s in g.samples]
    return SGroup(**{**{f: getattr(g, f) for f in SGroup.__struct_fields__}, "samples": samples})


def _dec_hook(tp, obj):
    if tp is np.ndarray:
        return array_from_map(obj)
    raise NotImplementedError


_S_ENC = msgspec.msgpack.Encoder(enc_hook=array_to_map)
_S_GROUP = msgspec.msgpack.Decoder(SGroupMessage, dec_hook=_dec_hook)
_S_BATCH = msgspec.msgpack.Decoder(SBatch, dec_hook=_dec_hook)


def struct_group(g: SGroup) -> SGroup:
    back = _S_GROUP.decode(_S_ENC.encode(SGroupMessage(g))).group
    validate_group(back)  # duck-typed: the same semantic checks
    return back


def struct_batch(groups: list[SGroup]) -> list[SGroup]:
    n = len(groups)
    back = _S_BATCH.decode(_S_ENC.encode(SBatch(groups, list(range(n)), [0.1] * n, [1.0] * n))).groups
    for g in back:
        validate_group(g)
    return back


# -- pydantic v2 ----------------------------------------------------------------------------------------


def _to_array(v):
    return array_from_map(v) if type(v) is dict else v


Array = Annotated[Any, pydantic.BeforeValidator(_to_array)]


class PSample(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, strict=True)
    uid: str
    response_ids: Array
    logprobs: Array
    text: str
    finish_reason: str
    reward: float | None = None
    token_rewards: Array | None = None
    reward_parts: dict[str, float] = {}
    reward_seconds: dict[str, float] = {}
    version_segments: list[list[int]] | None = None


class PGroup(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, strict=True)
    group_id: str
    prompt_uid: str
    task: str
    prompt: str
    answer: str
    prompt_ids: Array
    policy_version: int = pydantic.Field(ge=0)
    generator: str
    samples: list[PSample]
    rollout_s: float = 0.0
    reward_s: float = 0.0
    meta: dict[str, Any] = {}


class PGroupMessage(pydantic.BaseModel):
    kind: str = "group"
    schema_: int = pydantic.Field(1, alias="schema")
    group: PGroup


class PWantPrompts(pydantic.BaseModel):
    kind: str = "want_prompts"
    generator: str
    max_prompts: int = 1
    policy_version: int | None = None
    timeout_s: float = pydantic.Field(1.0, gt=0, allow_inf_nan=False)
    dropped: list[str] = []
    request_id: int | None = None


class PRow(pydantic.BaseModel):
    group_id: str
    prompt_uid: str
    text: str
    answer: str
    task: str


class PPrompts(pydantic.BaseModel):
    kind: str = "prompts"
    prompts: list[PRow] = []
    learner_version: int | None = None
    request_id: int | None = None


class PBatch(pydantic.BaseModel):
    kind: str = "batch"
    groups: list[PGroup] = []
    group_keys: list[int] = []
    probabilities: list[float] = []
    is_weights: list[float] = []
    request_id: int | None = None


def _ppack(model: pydantic.BaseModel) -> bytes:
    return msgpack.packb(model.model_dump(by_alias=True), default=array_to_map, use_bin_type=True)


def _punpack(frame: bytes) -> dict:
    return msgpack.unpackb(frame, raw=False, strict_map_key=True)


def _pgroup(g: Group) -> PGroup:
    return PGroup.model_validate({**group_to_dict(g), "samples": [PSample(**vars(s)) for s in g.samples]})


def pydantic_group(g: PGroup) -> PGroup:
    back = PGroupMessage.model_validate(_punpack(_ppack(PGroupMessage(group=g)))).group
    validate_group(back)
    return back


def pydantic_prompts() -> tuple:
    request = PWantPrompts.model_validate(
        _punpack(_ppack(PWantPrompts(generator="generator-0", max_prompts=16, policy_version=3)))
    )
    reply = PPrompts.model_validate(_punpack(_ppack(PPrompts(prompts=[PRow(**r) for r in ROWS], request_id=1))))
    return request, reply.prompts


def pydantic_batch(groups: list[PGroup]) -> list[PGroup]:
    n = len(groups)
    batch = PBatch(groups=groups, group_keys=list(range(n)), probabilities=[0.1] * n, is_weights=[1.0] * n)
    back = PBatch.model_validate(_punpack(_ppack(batch))).groups
    for g in back:
        validate_group(g)
    return back


# -- measurement ---------------------------------------------------------------------------------------


def per_call_us(fn, seconds: float) -> float:
    fn()  # warm
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        count += 1
    return 1e6 * elapsed / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    group = make_group(0, args.n, args.tokens)
    groups = [make_group(i, args.n, args.tokens) for i in range(args.batch_groups)]
    sgroup, sgroups = _struct_group(group), [_struct_group(g) for g in groups]
    pgroup, pgroups = _pgroup(group), [_pgroup(g) for g in groups]
    cases = {
        "group": {
            "dicts": lambda: dicts_group(group),
            "msgspec_dataclass": lambda: codec_group(group),
            "msgspec_struct": lambda: struct_group(sgroup),
            "pydantic": lambda: pydantic_group(pgroup),
        },
        "want_prompts+prompts": {
            "dicts": dicts_prompts,
            "msgspec_dataclass": codec_prompts,
            "msgspec_struct": codec_prompts,  # no records inside: the same types as msgspec_dataclass
            "pydantic": pydantic_prompts,
        },
        "batch": {
            "dicts": lambda: dicts_batch(groups),
            "msgspec_dataclass": lambda: codec_batch(groups),
            "msgspec_struct": lambda: struct_batch(sgroups),
            "pydantic": lambda: pydantic_batch(pgroups),
        },
    }
    samples: dict[str, dict[str, list[float]]] = {m: {w: [] for w in ways} for m, ways in cases.items()}
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits every way alike
        for message, ways in cases.items():
            for way, fn in ways.items():
                samples[message][way].append(per_call_us(fn, args.seconds))
    result: dict[str, Any] = {
        "tokens": args.tokens,
        "n": args.n,
        "batch_groups": args.batch_groups,
        "repeats": args.repeats,
        "msgspec": msgspec.__version__,
        "pydantic": pydantic.VERSION,
        "us_per_round_trip": {},
        "vs_dicts": {},
        "load_average": os.getloadavg(),
    }
    for message, ways in samples.items():
        medians = {way: statistics.median(v) for way, v in ways.items()}
        result["us_per_round_trip"][message] = {way: round(us, 2) for way, us in medians.items()}
        result["vs_dicts"][message] = {way: round(us / medians["dicts"], 3) for way, us in medians.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
