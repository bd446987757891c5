"""Publication-to-served time: seconds from the learner starting to publish version v to each
generator serving v, and where they go.

The controller joins two events it already hears: the learner's ``broadcast`` (``published_at``,
the wall clock when it began to publish; ``probe_s``; ``gather_s``, the time spent producing the buckets — the
state dict, a ZeRO-3 gather; ``seconds``, the whole publication) and each generator's ``version``
(``served_at``, the wall clock when it began serving; ``ready_at``, when the subscriber had the
version verified; ``receive_s``, ``load_s``, ``probe_s``). Per (version, generator):

| stage | seconds | spent in |
| --- | --- | --- |
| ``learner_probe_s`` | learner | the learner's logprobs of the probe text, sent along to be checked |
| ``gather_s`` | learner | producing each bucket (state dict, ZeRO gather, dtype cast) |
| ``transport_out_s`` | learner | writing/sending: shm files, zmq frames, a safetensors file, an NCCL broadcast |
| ``transport_in_s`` | generator | receiving and verifying: mapping shm, reading frames, checksums |
| ``wait_s`` | generator | verified, waiting for the generator to finish the batch it samples |
| ``reload_s`` | engine | loading the tensors into the engine (vLLM's ``reload_weights``), resetting its cache |
| ``probe_s`` | engine | scoring the probe text to check the weights took |
| ``total_s`` | end to end | ``served_at − published_at`` |

Stages may overlap (the shm subscriber checks each bucket while the learner writes the next), so
they need not add up to the total. Wall clocks of two processes are compared: exact on one host,
as good as the hosts' clock synchronisation (NTP: about a millisecond) on a cluster. A generator
that skips a version (a newer one arrived first) has no entry for it.

Memory is bounded for a run of any length: broadcasts and records are kept for the last ``keep``
versions (a version is served seconds after its broadcast), and what ``summary`` reports over
every record (count, mean, max) is kept as running sums; the median is over the kept records.
"""

from __future__ import annotations

import time

import numpy as np

from asyncrl.wire.messages import BroadcastEvent, VersionEvent

STAGES = ("learner_probe_s", "gather_s", "transport_out_s", "transport_in_s", "wait_s", "reload_s", "probe_s")


class PublicationTimeline:
    """Joins ``broadcast`` and ``version`` events into per-version, per-generator timings.

    >>> t = PublicationTimeline()
    >>> t.on_broadcast(BroadcastEvent(version=2, transport="shm", published_at=100.0, gather_s=0.5,
    ...     probe_s=0.0, bytes=64, buckets=1, seconds=1.5))
    []
    >>> [r["total_s"] for r in t.on_served(VersionEvent(source="generator-0", version=2, served_at=104.0,
    ...     ready_at=102.0, apply_s=1.0, load_s=0.8, receive_s=0.3, probe_s=0.2, bytes=64))]
    [4.0]
    """

    def __init__(self, max_pending: int = 1000, keep: int = 1000):
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be >= 1 version")
        self.broadcasts: dict[int, BroadcastEvent] = {}  # the last `keep` versions' broadcasts
        self.pending: dict[tuple[int, str], VersionEvent] = {}  # version events that came before their broadcast
        self.versions: dict[int, dict[str, dict]] = {}  # version -> generator -> stages, the last `keep` versions
        self.max_pending = max_pending
        self.keep = keep
        self.records = 0
        """Records joined over the whole run (``versions`` holds the last ``keep`` versions' only)."""
        self._sums = dict.fromkeys(("total_s", *STAGES), 0.0)
        self._max_total = float("-inf")

    def on_broadcast(self, ev: BroadcastEvent) -> list[dict]:
        """The learner published ``ev.version``; returns records completed by it."""
        version = ev.version
        self.broadcasts[version] = ev
        _keep_last(self.broadcasts, self.keep)
        done = []
        for key in [k for k in self.pending if k[0] == version]:
            done.append(self._join(ev, self.pending.pop(key)))
        return done

    def on_served(self, ev: VersionEvent) -> list[dict]:
        """A generator serves ``ev.version``; returns the record if its broadcast is known."""
        version = ev.version
        broadcast = self.broadcasts.get(version)
        if broadcast is None:
            if len(self.pending) < self.max_pending:
                self.pending[(version, ev.source)] = ev
            return []
        return [self._join(broadcast, ev)]

    def _join(self, broadcast: BroadcastEvent, served: VersionEvent) -> dict:
        gather = broadcast.gather_s
        began_apply = served.served_at - served.apply_s
        record = {
            "total_s": served.served_at - broadcast.published_at,
            "learner_probe_s": broadcast.probe_s,
            "gather_s": gather,
            "transport_out_s": max(0.0, broadcast.seconds - gather),
            "transport_in_s": served.receive_s,
            "wait_s": max(0.0, began_apply - served.ready_at) if served.ready_at else 0.0,
            "reload_s": served.load_s,
            "probe_s": served.probe_s,
        }
        self.versions.setdefault(served.version, {})[served.source] = record
        _keep_last(self.versions, self.keep)
        self.records += 1
        for key in self._sums:
            self._sums[key] += record[key]
        self._max_total = max(self._max_total, record["total_s"])
        return record

    def summary(self) -> dict:
        """``versions`` (version -> generator -> stages, the last ``keep`` versions), ``total_s``
        (n, mean and max over every record; p50 over the kept ones) and ``mean_s`` (each stage's
        mean over every record)."""
        out: dict = {"versions": {str(v): gens for v, gens in sorted(self.versions.items())}}
        if not self.records:
            out["total_s"], out["mean_s"] = {"n": 0}, {}
            return out
        kept = [r["total_s"] for gens in self.versions.values() for r in gens.values()]
        out["total_s"] = {
            "n": self.records,
            "mean": self._sums["total_s"] / self.records,
            "p50": float(np.median(kept)),
            "max": self._max_total,
        }
        out["mean_s"] = {s: self._sums[s] / self.records for s in STAGES}
        return out


def _keep_last(by_version: dict, keep: int) -> None:
    """Drop the entries inserted first (the oldest versions) until ``keep`` remain."""
    while len(by_version) > keep:
        del by_version[next(iter(by_version))]


def describe(values) -> dict:
    """``{n, mean, p50, max}`` of a list of seconds ({"n": 0} when empty)."""
    if len(values) == 0:
        return {"n": 0}
    arr = np.asarray(values, dtype=np.float64)
    return {"n": int(arr.size), "mean": float(arr.mean()), "p50": float(np.median(arr)), "max": float(arr.max())}


class TimedBuckets:
    """Wraps the learner's bucket iterator and adds up the seconds spent producing buckets
    (``gather_s``: the state dict, a ZeRO-3 gather, a dtype cast), apart from the transport's time
    consuming them.

    >>> buckets = TimedBuckets(iter([[("w", 1)], [("b", 2)]]))
    >>> len(list(buckets)), buckets.seconds >= 0
    (2, True)
    """

    def __init__(self, buckets, clock=time.perf_counter):
        self.buckets = iter(buckets)
        self.clock = clock
        self.seconds = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = self.clock()
        try:
            return next(self.buckets)
        finally:
            self.seconds += self.clock() - start
