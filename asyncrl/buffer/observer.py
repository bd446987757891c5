"""The buffer's observer: what the replay buffer reports, to Prometheus and to the group ledger."""

from __future__ import annotations

from asyncrl.observability import metrics as m


class BufferMetrics:
    """The buffer's observer: feeds the Prometheus metrics of ``asyncrl.observability.metrics``, and collects the
    ids of dropped groups for the group ledger and the dispatcher's status report."""

    def __init__(self, ledger=None):
        self.ledger = ledger
        self.dropped_ids: list[str] = []

    def on_drop_groups(self, group_ids: list[str], reason: str) -> None:
        if reason != "duplicate":  # a dropped copy settles nothing: the original goes on
            self.dropped_ids.extend(group_ids)
        if self.ledger is not None:
            self.ledger.write("dropped", group_ids, reason=reason)

    def on_insert(self, priorities) -> None:
        m.BUFFER_INSERTED.inc(len(priorities))
        for p in priorities:
            m.BUFFER_PRIORITY.observe(float(p))

    def on_sample(self, age_versions, age_s, samples) -> None:
        for v, s in zip(age_versions.tolist(), age_s.tolist()):
            m.BUFFER_SAMPLE_AGE_VERSIONS.observe(v)
            m.BUFFER_SAMPLE_AGE_SECONDS.observe(s)

    def on_remove(self, reason: str, samples: int) -> None:
        m.BUFFER_REMOVED.labels(reason).inc(samples)
