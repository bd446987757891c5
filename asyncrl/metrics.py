"""Prometheus metrics of one process, served on a local port.

Each process calls ``serve_metrics(run_dir, name)`` once: it starts an HTTP server on 127.0.0.1
(port 0 = any free port) answering ``/metrics`` and ``/health``, and writes the port to
``run_dir/metrics/{name}.port``, from which the controller writes the run's scrape config
(``run_dir/prometheus.yml``); at exit the process writes its last values to
``run_dir/metrics/{name}.prom``. Metric objects live in one registry per process
(``REGISTRY``); names are ``asyncrl_*`` with units in the name, as Prometheus advises.
"""

from __future__ import annotations

import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_wsgi_app

REGISTRY = CollectorRegistry()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

REJECTED_FRAMES = Counter(
    "asyncrl_rejected_frames", "Frames rejected by a receiver, by reason.", ["socket", "reason"], registry=REGISTRY
)
ROLLOUT_SECONDS = Histogram(
    "asyncrl_rollout_seconds", "Seconds to sample one group.", buckets=LATENCY_BUCKETS, registry=REGISTRY
)
REWARD_SECONDS = Histogram(
    "asyncrl_reward_seconds", "Seconds to score one group.", buckets=LATENCY_BUCKETS, registry=REGISTRY
)
LEARNER_STEP_SECONDS = Histogram(
    "asyncrl_learner_step_seconds", "Seconds per learner optimizer step.", buckets=LATENCY_BUCKETS, registry=REGISTRY
)
BUFFER_GROUPS = Gauge("asyncrl_buffer_groups", "Groups held by the replay buffer.", registry=REGISTRY)
BUFFER_SAMPLES = Gauge("asyncrl_buffer_samples", "Samples held by the replay buffer.", registry=REGISTRY)
STALENESS = Histogram(
    "asyncrl_staleness_versions",
    "Staleness of trained samples: learner version at the update minus the sampling version.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
    registry=REGISTRY,
)
POLICY_VERSION = Gauge("asyncrl_policy_version", "Policy version this process holds or serves.", registry=REGISTRY)
SAMPLES = Counter("asyncrl_samples", "Samples passing this process, by outcome.", ["outcome"], registry=REGISTRY)
DROPPED = Counter("asyncrl_dropped_samples", "Samples dropped, by reason.", ["reason"], registry=REGISTRY)
BUSY_SECONDS = Counter(
    "asyncrl_busy_seconds",
    "Seconds spent on the work the process exists for (sampling, optimizer steps); its rate is the busy fraction.",
    ["role"],
    registry=REGISTRY,
)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a scrape every few seconds must not fill the log
        pass


def metrics_app(environ, start_response):
    """``/metrics`` (and any other path, as Prometheus' own exporters do) and ``/health``."""
    if environ.get("PATH_INFO") == "/health":
        start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"ok\n"]
    return _METRICS_APP(environ, start_response)


_METRICS_APP = make_wsgi_app(REGISTRY)


def serve_metrics(run_dir: str | Path | None, name: str) -> int:
    """Serve ``/metrics`` and ``/health`` on 127.0.0.1 at a free port, in a daemon thread; record
    the port (when there is a run directory); return it."""
    server = make_server("127.0.0.1", 0, metrics_app, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    port = server.server_port
    if run_dir is not None:
        path = Path(run_dir) / "metrics" / f"{name}.port"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(port))
    return port


def write_metrics_snapshot(run_dir: str | Path, name: str) -> Path:
    """Write the registry in the text exposition format to ``run_dir/metrics/{name}.prom``
    (at exit, so the last values outlive the process and its port)."""
    path = Path(run_dir) / "metrics" / f"{name}.prom"
    path.write_bytes(generate_latest(REGISTRY))
    return path


# -- replay buffer ---------------------------------------------------------------------------
BUFFER_BYTES = Gauge(
    "asyncrl_buffer_bytes", "Bytes of token ids and logprobs held by the replay buffer.", registry=REGISTRY
)
BUFFER_INSERTED = Counter("asyncrl_buffer_inserted_groups", "Groups stored by the replay buffer.", registry=REGISTRY)
BUFFER_SAMPLED = Counter(
    "asyncrl_buffer_sampled_groups", "Groups handed to learners, first hand-out or repeat.", ["use"], registry=REGISTRY
)
BUFFER_REMOVED = Counter(
    "asyncrl_buffer_removed_samples",
    "Samples that left the replay buffer other than by a hand-out, by reason (evicted, stale, max_times_sampled...).",
    ["reason"],
    registry=REGISTRY,
)
BUFFER_SAMPLE_AGE_VERSIONS = Histogram(
    "asyncrl_buffer_sample_age_versions",
    "Learner version minus the group's policy version when the buffer hands it out.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
    registry=REGISTRY,
)
BUFFER_SAMPLE_AGE_SECONDS = Histogram(
    "asyncrl_buffer_sample_age_seconds",
    "Seconds a group waited in the buffer before a hand-out.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
BUFFER_PRIORITY = Histogram(
    "asyncrl_buffer_priority",
    "Priority of each group as it arrives (before the floor).",
    buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1, 2, 5),
    registry=REGISTRY,
)
BUFFER_RATE_LIMITED_SECONDS = Counter(
    "asyncrl_buffer_rate_limited_seconds",
    "Seconds inserts or samples were held by the rate limiter.",
    ["side"],
    registry=REGISTRY,
)

# -- reward workers --------------------------------------------------------------------------
REWARD_LATENCY = Histogram(
    "asyncrl_reward_latency_seconds",
    "Seconds one reward took to score one group (all its samples), by reward.",
    ["reward"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
REWARD_REQUESTS = Counter(
    "asyncrl_reward_requests", "HTTP requests sent by a reward (retries included).", ["reward"], registry=REGISTRY
)
REWARD_RETRIES = Counter("asyncrl_reward_retries", "Requests retried, by reward.", ["reward"], registry=REGISTRY)
REWARD_ERRORS = Counter(
    "asyncrl_reward_errors",
    "Failed reward calls by kind (timeout, http_429, http_5xx, bad_json, circuit_open...), retried or not.",
    ["reward", "kind"],
    registry=REGISTRY,
)
REWARD_UNSCORED = Counter(
    "asyncrl_reward_unscored_samples",
    "Samples a reward left unscored, by reason.",
    ["reward", "reason"],
    registry=REGISTRY,
)
REWARD_QUEUE_DEPTH = Gauge(
    "asyncrl_reward_queue_groups", "Groups waiting in a reward worker, by state.", ["state"], registry=REGISTRY
)

# -- weight sync -----------------------------------------------------------------------------
WEIGHT_BROADCAST_SECONDS = Histogram(
    "asyncrl_weight_broadcast_seconds",
    "Seconds the learner spent publishing one version (gather, pack, send or write).",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
WEIGHT_BYTES = Counter(
    "asyncrl_weight_bytes", "Bytes of weights published (learner) or received (generator).", registry=REGISTRY
)
WEIGHT_APPLY_SECONDS = Histogram(
    "asyncrl_weight_apply_seconds",
    "Seconds a generator took to receive, verify, load and probe one version.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
WEIGHT_FAILURES = Counter(
    "asyncrl_weight_failures",
    "Weight updates that failed, by stage (receive: checksum, order, timeout; apply: load, probe; send: stalled subscriber).",
    ["stage"],
    registry=REGISTRY,
)
