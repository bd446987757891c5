"""Load the newest announced weights into a generator's engine, check them, and report the version served.

Used by the generator loop between engine calls (``weights.apply_mode: between_requests``) and by
the in-flight applier's thread (``asyncrl.generators.inflight``).
"""

from __future__ import annotations

import time

from asyncrl.generators.context import GeneratorContext
from asyncrl.observability.metrics import POLICY_VERSION, WEIGHT_APPLY_SECONDS, WEIGHT_BYTES, WEIGHT_FAILURES
from asyncrl.weights.probe import ProbeCheck
from asyncrl.wire.messages import VersionEvent


def apply_newest_weights(engine, weights, ctx: GeneratorContext, probe: ProbeCheck | None = None) -> None:
    """Load the newest published version if it is newer than the one served; check it; report it.

    ``weights`` is a subscriber of ``asyncrl.weights`` (its ``newest`` verifies each bucket's
    checksum). With a ``probe`` check and a probe sent along, the engine then scores the probe
    text and must match the learner's logprobs (``asyncrl.weights.probe.ProbeCheck``: calibrated
    before the first load on the weights both sides share). A version whose meta says ``adapter``
    (``model.lora``) carries only LoRA tensors, which the engine serves as a new adapter
    (``asyncrl.generators.engines.lora``). Any failure (checksum, missing weights, probe) is
    counted, reported back to the learner where the transport can, and raised: a generator must
    never go on sampling with weights it cannot vouch for.
    """
    start = time.perf_counter()
    try:
        update = weights.newest(engine.version)
    except Exception:
        WEIGHT_FAILURES.labels("receive").inc()
        raise
    if update is None:
        return
    try:
        sent = update.meta.get("probe")
        checked = probe is not None and sent is not None and hasattr(engine, "score")
        probe_start = time.perf_counter()
        if checked:
            probe.before_load(engine, sent)
        calibrate_s = time.perf_counter() - probe_start
        weights_in = update.path if update.path is not None else update.tensors
        adapter = update.meta.get("adapter")  # model.lora: the version is only the adapter's tensors
        if adapter is not None:
            load_s = engine.load_weights(weights_in, update.version, adapter=adapter)
        elif update.shm is not None and getattr(engine, "maps_shm", False):  # the engine process maps them itself
            load_s = engine.load_weights(weights_in, update.version, shm=update.shm)
        else:
            load_s = engine.load_weights(weights_in, update.version)
        result = None
        probe_start = time.perf_counter()
        if checked:
            result = probe.check(engine, sent, update.version)
        probe_s = time.perf_counter() - probe_start + calibrate_s
    except Exception as e:
        WEIGHT_FAILURES.labels("apply").inc()
        update.done(error=f"{type(e).__name__}: {e}")
        raise
    update.done()
    apply_s = time.perf_counter() - start
    POLICY_VERSION.set(engine.version)
    WEIGHT_APPLY_SECONDS.observe(apply_s)
    WEIGHT_BYTES.inc(update.nbytes)
    ctx.emit(
        VersionEvent(
            version=engine.version,
            apply_s=apply_s,
            load_s=load_s,
            receive_s=update.receive_s,
            probe_s=probe_s,
            ready_at=update.ready_at,
            served_at=time.time(),  # wall clock, joined with the learner's published_at (asyncrl.weights.timeline)
            bytes=update.nbytes,
            probe_diff=None if result is None else result.mean_diff,
            probe=result,
        )
    )
