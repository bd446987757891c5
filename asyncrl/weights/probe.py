"""The probe: after a weight update, the generator's logprobs of a fixed text must match the learner's.

The learner scores a fixed prompt + continuation (dozens of tokens) with the weights it just
published (``learner_probe``) and sends them along with the version (``Probe``), together with
its logprobs of the same text at the version it published before. The generator, once it has
applied the version, scores the same tokens with its engine (``VLLMEngine.score``: temperature-1
prompt logprobs) and ``ProbeCheck`` decides whether it serves the published weights.

Why calibrated, not a fixed tolerance: an engine and a learner never agree exactly. Their
kernels sum in other orders, and a 16-bit side rounds every weight and activation; over 30
layers of a pretrained model the per-token gap at identical weights is ~3e-3 in float32 and
~5e-2 in bfloat16 (SmolLM2-135M), well above what a two-layer toy shows (~1e-6). A tolerance
fixed by dtype and held against the largest of two tokens failed healthy updates of a real model
(and a failure that repeats at each restart became a restart loop). So the check:

1. **learns the mismatch at identical weights**: at the first update whose previous version is
   the one the engine serves (at start: the initial weights on both sides), the engine scores the
   text *before* loading and compares with the learner's logprobs of that previous version:
   ``noise = mean_t |Δ_t|``. The bound is then ``tol = max(noise_factor × noise, MIN_ATOL)``;
   until a calibration, ``atol`` (by dtype, ``probe_tolerance``) is the bound;
2. **tests a mean over the whole text**, not the largest of a few tokens (a mean over dozens of
   tokens moves far less between two healthy versions than any single position does);
3. **tells a failed load from numerics**: an update passes when ``mean|G − L_new| ≤ tol``, or,
   before any calibration (the bound is then only a guess by dtype), when the served logprobs are
   at least ``SEPARATION`` times closer to the new version's than to the previous version's.
   Weights that did not load sit at the previous version (``mean|G − L_prev|`` ≈ noise); weights
   in the wrong tensors or corrupted give differences of order 1 and more, far from both; a
   partial load (one tensor left stale) lands in between, which only the calibrated bound sees:
   it is how the stale tied head of ``asyncrl.generators.engines.tied_head`` was found (6e-4 after one
   step of a float32 SmolLM2, against 6e-6 at identical weights).

When the new and previous versions are closer to each other than ``tol`` (a tiny learning rate),
no probe can tell them apart: the update passes and ``separation`` in its statistics says so.

**Adapters** (``model.lora``: each version is only a LoRA adapter, served on base weights the
generator keeps). The failure peers shipped for months is an engine that silently serves the
base model instead of the adapter (the request never named the adapter, or the adapter never
loaded): its logprobs are the base model's, which drift only slowly away from the adapter's as
training goes on, so a loose bound lets them pass. The learner therefore also sends the base
model's logprobs of the probe text (``base_logprobs``: peft's ``disable_adapter``), and an
update fails when the served logprobs are the base's rather than the adapter's
(``serves_base``: ``mean|G − B|`` against ``mean|G − L|``), whatever the bound says. While the
adapter still is the base (peft starts lora_B at zero) no probe can tell them apart, and
``base_diff`` and ``base_separation`` in the statistics say so.

Statistics of every check (``asyncrl.wire.messages.ProbeStats``) go out with the generator's ``version`` event: mean
and max |Δ| against the new version, the same against the previous one, the bound and the
calibrated noise. The per-token mismatch KL on sampled tokens is the learner's ``mismatch_kl``
step statistic (``asyncrl.learner.step_stats``), measured on real answers at staleness 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from asyncrl.weights.update import WeightSyncError
from asyncrl.wire.messages import ProbeStats

PROBE_TOLERANCES = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 0.15}
"""Probe bound before calibration, on the mean |Δ| over the probe text, by the coarser dtype of
the two sides. A float32 engine and learner agree to ~6e-6 (SmolLM2-135M, 30 layers; measured
by ``bench/mismatch_kl.py``); a 16-bit side rounds every weight and activation (relative error
2^-11 for float16, 2^-8 for bfloat16), which the same model turns into a mean difference of 0.054
with bfloat16 on both sides (0.037 with a float32 engine): the bounds keep a factor of about three
above that (float16: 8 times finer than bfloat16), far below what a weight that did not load
gives (order 1)."""
_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "auto": "bfloat16",
    # Decided on the device that computes, not here: the looser tolerance holds either way.
    "bf16_if_native": "bfloat16",
    "bfloat16_if_native": "bfloat16",
}

MIN_ATOL = 1e-4
"""Lowest calibrated bound: two sides that agree to the last bit at identical weights would
otherwise give a bound of 0, which a reordered sum after an update breaks."""
SEPARATION = 4.0
"""An update also passes when the served logprobs are this many times closer (mean |Δ|) to the
new version's than to the previous version's: clearly moved to the new weights."""
BASE_MARGIN = 2.0
"""With an adapter, once calibrated: adapter and base this many times the noise apart on the probe
text are told apart (``serves_base``): a comparison of two distances needs less margin than a bound."""
CALIBRATION_LIMIT = 10.0
"""At identical weights the mismatch may be at most this many times the dtype bound (``atol``):
more is not numerics but two different models (the engine loaded another folder)."""

PROBE_PROMPT = "12+34="
PROBE_CONTINUATION = (
    "46\n27+58=85\n63+19=82\nThe sum of 40 and 45 is 85, and 7 times 8 is 56.\n"
    "Question: Tom has 3 apples and buys 9 more. How many apples does he have?\nAnswer: 3 + 9 = 12. #### 12\n"
)
"""Arithmetic and a short word problem: every character is in the tiny models' character
vocabulary, and a pretrained BPE model reads it as ordinary text (~45 tokens for SmolLM2's
tokenizer). ``learner_probe`` cuts it to fit the engine's ``max_model_len``."""


@dataclass
class Probe:
    """What the learner sends with a version (``WeightsAnnouncement.probe``, as ``to_wire()``):
    the probe text's token ids and the learner's logprobs of them at ``version``, and at the
    version it published before (``previous_version``; None for the first publication of a
    resumed learner, which no longer has those weights); with an adapter (``model.lora``), the
    base model's logprobs too (``base_logprobs``: the adapter disabled)."""

    prompt: str
    continuation_ids: list[int]
    logprobs: list[float]
    version: int | None = None
    previous_version: int | None = None
    previous_logprobs: list[float] | None = None
    base_logprobs: list[float] | None = None

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, body: dict) -> Probe:
        """A probe as received; a malformed one is a ``WeightSyncError`` naming the field."""
        try:
            probe = cls(**body)
        except TypeError as e:
            raise WeightSyncError(f"probe ({sorted(body)}): not a probe: {e}") from None
        n = len(probe.continuation_ids)
        for name in ("logprobs", "previous_logprobs", "base_logprobs"):
            values = getattr(probe, name)
            if values is not None and len(values) != n:
                raise WeightSyncError(f"probe {name} has {len(values)} values for {n} continuation tokens")
        return probe

    def after(self, version: int, logprobs: list[float], base_logprobs: list[float] | None = None) -> Probe:
        """The probe of the next publication: this one's logprobs become its previous ones (the
        base model's stay this one's unless given: an adapter's base weights are frozen)."""
        base = self.base_logprobs if base_logprobs is None else base_logprobs
        return Probe(self.prompt, self.continuation_ids, logprobs, version, self.version, self.logprobs, base)


def learner_probe(
    model,
    tokenizer,
    prompt: str = PROBE_PROMPT,
    continuation: str = PROBE_CONTINUATION,
    max_len: int | None = None,
) -> dict:
    """Temperature-1 logprobs the (full, unpartitioned) ``model`` gives ``continuation`` after
    ``prompt``, the continuation cut so that prompt + continuation stay below ``max_len`` tokens
    (the engine's ``max_model_len``; it scores them as one prompt). A peft model (``model.lora``)
    is scored twice: with its adapter (``logprobs``) and without (``base_logprobs``), so that a
    generator serving the base model instead of the adapter is caught (``ProbeCheck``)."""

    prompt_ids = list(tokenizer.encode(prompt))
    cont_ids = list(tokenizer.encode(continuation, add_special_tokens=False))
    if max_len is not None:
        room = max_len - 1 - len(prompt_ids)
        if room < 1:
            raise ValueError(f"probe prompt ({len(prompt_ids)} tokens) must be shorter than max_len ({max_len}) - 1")
        cont_ids = cont_ids[:room]
    body = {"prompt": prompt, "continuation_ids": cont_ids, "logprobs": _logprobs(model, prompt_ids, cont_ids)}
    if hasattr(model, "disable_adapter") and getattr(model, "peft_config", None):  # a peft model
        body["base_logprobs"] = _base_logprobs(model, prompt_ids, cont_ids)
    return body


def _base_logprobs(model, prompt_ids: list[int], cont_ids: list[int]) -> list[float]:
    """The base model's logprobs (the adapter disabled), computed once per text: under LoRA the
    base weights are frozen, so every later version would pay a second forward pass for the same
    numbers. (Every rank calls this alike, so under ZeRO-3 each one skips the same collective.)"""
    key = (tuple(prompt_ids), tuple(cont_ids))
    cache = model.__dict__.setdefault("_asyncrl_base_logprobs", {})
    if key not in cache:
        with model.disable_adapter():
            cache[key] = _logprobs(model, prompt_ids, cont_ids)
    return list(cache[key])


def _logprobs(model, prompt_ids: list[int], cont_ids: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt_ids + cont_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0]  # (P+C, V)
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)  # (C, V)
    picked = logprobs.gather(1, torch.tensor(cont_ids, device=logits.device)[:, None])[:, 0]
    return picked.cpu().numpy().astype(np.float32).tolist()


class ProbeCheck:
    """A generator's probe: calibrates once at identical weights, then checks every update.

    >>> check = ProbeCheck(atol=1e-2)
    >>> check.tol
    0.01
    >>> check.calibrate(np.array([-1.0, -2.0]), np.array([-1.01, -2.03]))
    0.02
    >>> round(check.tol, 6)  # 5 x the mean mismatch at identical weights
    0.1
    """

    def __init__(self, atol: float, noise_factor: float = 5.0):
        if not atol > 0:
            raise ValueError(f"atol ({atol}) must be > 0")
        if not noise_factor >= 1:
            raise ValueError(f"noise_factor ({noise_factor}) must be >= 1")
        self.atol = atol
        self.noise_factor = noise_factor
        self.noise: float | None = None

    @property
    def tol(self) -> float:
        """The bound on the mean |Δ|: ``atol`` until calibrated, then the calibrated one."""
        if self.noise is None:
            return self.atol
        return max(self.noise_factor * self.noise, MIN_ATOL)

    def calibrate(self, engine_logprobs: np.ndarray, learner_logprobs: np.ndarray) -> float:
        """Learn the mismatch from both sides' logprobs of the same text at the same weights."""
        noise = float(np.mean(np.abs(np.asarray(engine_logprobs, np.float64) - np.asarray(learner_logprobs))))
        if not noise <= CALIBRATION_LIMIT * self.atol:
            raise WeightSyncError(
                f"probe at identical weights: the engine's logprobs differ from the learner's by {noise:.3g} on average, "
                f"more than {CALIBRATION_LIMIT:g} x the dtype bound {self.atol:g}: the engine and the learner do not run "
                "the same model (check model.path and the engine's dtype)"
            )
        self.noise = noise
        return round(noise, 6)

    def before_load(self, engine, body: dict) -> None:
        """Before loading a version: calibrate, once, if the engine serves the probe's previous version."""
        probe = Probe.from_wire(body)
        if self.noise is not None or probe.previous_logprobs is None or probe.previous_version != engine.version:
            return
        got = engine.score(probe.prompt, list(probe.continuation_ids))
        self.calibrate(got, np.asarray(probe.previous_logprobs, np.float64))

    def check(self, engine, body: dict, version: int) -> ProbeStats:
        """Score the probe on ``engine`` after loading ``version``; raise if it does not serve it."""
        probe = Probe.from_wire(body)
        got = np.asarray(engine.score(probe.prompt, list(probe.continuation_ids)), dtype=np.float64)
        want = np.asarray(probe.logprobs, dtype=np.float64)
        if got.shape != want.shape or not len(want):
            raise WeightSyncError(
                f"probe after applying version {version}: {got.shape} logprobs for {want.shape} tokens"
            )
        diff = np.abs(got - want)
        prev = None if probe.previous_logprobs is None else np.asarray(probe.previous_logprobs, np.float64)
        base = None if probe.base_logprobs is None else np.asarray(probe.base_logprobs, np.float64)
        result = ProbeStats(
            mean_diff=float(diff.mean()),
            max_diff=float(diff.max()),
            tol=self.tol,
            noise=self.noise,
            previous_diff=None if prev is None else float(np.abs(got - prev).mean()),
            separation=None if prev is None else float(np.abs(want - prev).mean()),
            tokens=len(want),
            base_diff=None if base is None else float(np.abs(got - base).mean()),
            base_separation=None if base is None else float(np.abs(want - base).mean()),
        )
        if serves_base(result):
            raise WeightSyncError(self._base_failure(result, version))
        # Before a calibration the bound is a guess by dtype: an update that clearly moved to the new
        # weights passes. After it the bound is measured, and holds alone: a partial load (a stale
        # tensor) also moves toward the new version, only not all the way.
        moved = (
            self.noise is None
            and result.previous_diff is not None
            and result.mean_diff * SEPARATION <= result.previous_diff
        )
        if not (result.mean_diff <= result.tol or moved):
            raise WeightSyncError(self._failure(result, version, probe.previous_version))
        return result

    def _base_failure(self, r: ProbeStats, version: int) -> str:
        return (
            f"probe after applying version {version}: the engine serves the base model, not the adapter: its "
            f"logprobs are {r.base_diff:.3g} from the base model's and {r.mean_diff:.3g} from the adapter's on "
            f"average over {r.tokens} tokens, where adapter and base stand {r.base_separation:.3g} apart (> {r.tol:.3g})"
        )

    def _failure(self, r: ProbeStats, version: int, previous_version: int | None) -> str:
        bound = (
            f"{self.noise_factor:g} x the mismatch at identical weights ({r.noise:.3g})"
            if r.noise is not None
            else "weights.probe_atol (not calibrated yet)"
        )
        what = "the served weights are not the published ones"
        if r.previous_diff is not None and r.previous_diff <= r.tol:
            what = f"the engine still serves version {previous_version}'s weights: the update did not load"
        elif r.previous_diff is not None:
            what = "the served weights are neither the published version's nor the previous one's"
        return (
            f"probe after applying version {version}: generator logprobs differ from the learner's by "
            f"{r.mean_diff:.3g} on average over {r.tokens} tokens (max {r.max_diff:.3g}) > {r.tol:.3g}, "
            f"{bound}: {what}"
        )


def serves_base(r: ProbeStats) -> bool:
    """Whether a check's statistics show the base model served instead of the adapter.

    Two distances decide, not the bound alone (a bound loose enough for bfloat16 numerics holds a
    young adapter's distance from the base too): the served logprobs are ``SEPARATION`` times
    closer to the base's than to the adapter's (at any bound); or adapter and base stand more
    than ``BASE_MARGIN`` times the calibrated noise apart (before a calibration: the bound) and
    the served logprobs are no closer to the adapter's than to the base's. An adapter that still
    is the base (``base_separation`` within ``MIN_ATOL``) passes: nothing tells them apart.

    >>> serves_base(ProbeStats(mean_diff=0.2, max_diff=1.0, tol=0.5, tokens=9, base_diff=0.01, base_separation=0.2))
    True
    >>> serves_base(ProbeStats(mean_diff=0.01, max_diff=0.1, tol=0.5, tokens=9, base_diff=0.2, base_separation=0.2))
    False
    """
    if r.base_diff is None or r.base_separation is None or r.base_separation <= MIN_ATOL:
        return False
    if r.base_diff * SEPARATION <= r.mean_diff:
        return True
    floor = r.tol if r.noise is None else BASE_MARGIN * r.noise
    return r.base_separation > floor and r.base_diff <= r.mean_diff


def probe_tolerance(engine_dtype: str, trainer_dtype: str) -> float:
    """The probe's bound before calibration (on the mean |Δ|) for an engine in ``engine_dtype``
    (``float32``, ``bfloat16``, ``float16``, ``auto``: the model's own, taken as bfloat16, the
    usual checkpoint dtype; ``bfloat16_if_native``: taken as bfloat16) and a learner in
    ``trainer_dtype`` (``fp32``, ``bf16``, ``bf16_if_native``: taken as bf16): the looser of the
    two sides'.

    >>> probe_tolerance("float32", "fp32"), probe_tolerance("bfloat16", "bf16"), probe_tolerance("float32", "bf16")
    (0.001, 0.15, 0.15)
    """
    sides = []
    for dtype in (engine_dtype, trainer_dtype):
        name = _ALIASES.get(dtype, dtype)
        if name not in PROBE_TOLERANCES:
            raise ValueError(f"dtype ({dtype!r}) must be one of {sorted(PROBE_TOLERANCES) + sorted(_ALIASES)}")
        sides.append(PROBE_TOLERANCES[name])
    return max(sides)
