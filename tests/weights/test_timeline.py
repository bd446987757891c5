import pytest

from asyncrl.weights.timeline import STAGES, PublicationTimeline, TimedBuckets, describe
from asyncrl.wire import WireError, decode, encode_map
from asyncrl.wire.messages import BroadcastEvent, VersionEvent


def _broadcast(version, at=100.0):
    return BroadcastEvent(
        version=version, transport="shm", published_at=at, probe_s=0.1, gather_s=0.5, bytes=64, buckets=1, seconds=1.5
    )


def _served(source, version, at, ready_at=None, apply_s=1.0):
    return VersionEvent(
        source=source,
        version=version,
        served_at=at,
        ready_at=ready_at if ready_at is not None else at - apply_s,
        apply_s=apply_s,
        load_s=0.7,
        receive_s=0.3,
        probe_s=0.2,
        bytes=64,
    )


def test_each_generator_gets_its_stages_for_the_version_it_serves():
    t = PublicationTimeline()
    assert t.on_broadcast(_broadcast(2)) == []
    (record,) = t.on_served(_served("generator-0", 2, at=104.0, ready_at=102.0))
    assert record["total_s"] == pytest.approx(4.0)
    assert record["gather_s"] == 0.5 and record["transport_out_s"] == pytest.approx(1.0)
    assert record["learner_probe_s"] == 0.1
    assert record["transport_in_s"] == 0.3 and record["reload_s"] == 0.7 and record["probe_s"] == 0.2
    # verified at 102, began applying at 104 - 1: waited 1 s for the batch being sampled
    assert record["wait_s"] == pytest.approx(1.0)
    t.on_served(_served("generator-1", 2, at=103.0))
    summary = t.summary()
    assert set(summary["versions"]["2"]) == {"generator-0", "generator-1"}
    assert summary["total_s"] == {"n": 2, "mean": 3.5, "p50": 3.5, "max": 4.0}
    assert set(summary["mean_s"]) == set(STAGES)


def test_a_version_served_before_its_broadcast_arrives_is_joined_later():
    t = PublicationTimeline()
    assert t.on_served(_served("generator-0", 4, at=110.0)) == []
    (record,) = t.on_broadcast(_broadcast(4, at=105.0))
    assert record["total_s"] == pytest.approx(5.0)
    assert t.summary()["versions"]["4"]["generator-0"] is record


def test_events_without_timestamps_never_reach_the_timeline():
    """The times are declared fields of both events: a frame without them is refused on the wire."""
    for body in (
        {"type": "broadcast", "version": 1, "seconds": 1.0},
        {"type": "version", "version": 1, "apply_s": 0.1},
    ):
        with pytest.raises(WireError, match="bad_fields"):
            decode(encode_map("event", body))
    assert PublicationTimeline().summary() == {"versions": {}, "total_s": {"n": 0}, "mean_s": {}}


def test_timed_buckets_count_only_the_producer():
    now = [0.0]

    def gather():  # 2 s to produce each bucket
        for i in range(3):
            now[0] += 2.0
            yield [(f"w{i}", i)]

    buckets = TimedBuckets(gather(), clock=lambda: now[0])
    names = []
    for bucket in buckets:  # the transport: 5 s to write each
        now[0] += 5.0
        names.append(bucket[0][0])
    assert names == ["w0", "w1", "w2"]
    assert buckets.seconds == 6.0


def test_describe():
    assert describe([]) == {"n": 0}
    assert describe([1.0, 3.0, 2.0]) == {"n": 3, "mean": 2.0, "p50": 2.0, "max": 3.0}


def test_a_long_run_keeps_the_last_versions_and_sums_over_all():
    """Memory stays bounded however many versions a run publishes; count, mean and max still
    cover every record."""
    t = PublicationTimeline(keep=10)
    for v in range(1, 501):
        t.on_broadcast(_broadcast(v, at=100.0 * v))
        for g, delay in (("generator-0", 2.0), ("generator-1", 4.0 if v == 7 else 3.0)):
            t.on_served(_served(g, v, at=100.0 * v + delay))
    assert len(t.broadcasts) == 10 and len(t.versions) == 10
    summary = t.summary()
    assert sorted(int(v) for v in summary["versions"]) == list(range(491, 501))
    assert summary["total_s"]["n"] == 1000
    assert summary["total_s"]["mean"] == pytest.approx((2.0 * 500 + 3.0 * 499 + 4.0) / 1000)
    assert summary["total_s"]["max"] == pytest.approx(4.0)  # version 7's, long dropped from versions
    assert summary["total_s"]["p50"] == pytest.approx(2.5)  # over the kept versions
    assert summary["mean_s"]["reload_s"] == pytest.approx(0.7)


def test_keep_must_hold_a_version():
    with pytest.raises(ValueError, match="keep"):
        PublicationTimeline(keep=0)
