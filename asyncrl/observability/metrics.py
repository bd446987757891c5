"""Prometheus metrics of one process, served on a local port.

Each process calls ``serve_metrics(run_dir, name)`` once: it starts an HTTP server on 127.0.0.1
(port 0 = any free port) answering ``/metrics`` and ``/health``, and writes the port to
``run_dir/metrics/{name}.port``, from which the controller writes the run's scrape config
(``run_dir/prometheus.yml``); at exit the process writes its last values to
``run_dir/metrics/{name}.prom``. Metric objects live in one registry per process
(``REGISTRY``).

Names follow Prometheus conventions: ``asyncrl_`` prefix, base units in the name (``_seconds``,
``_bytes``), ``_total`` on counters (the client appends it). Metrics that every kind of process
reports (``asyncrl_policy_version``, ``asyncrl_busy_seconds_total``) carry a ``component`` label,
the process's name (``generator-0``, ``learner``, ``buffer``), so one query compares them all;
call sites write ``POLICY_VERSION.set(v)`` and the label is filled in. GPU memory gauges appear
only in a process that has initialised CUDA.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

from asyncrl.observability.step_stats import StepStats

REGISTRY = CollectorRegistry()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
VERSION_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)

_component = "main"  # this process's name; serve_metrics sets it


def component() -> str:
    """The ``component`` label of this process's metrics (its name, e.g. ``generator-0``)."""
    return _component


def set_component(name: str) -> None:
    global _component
    if not name:
        raise ValueError(f"component name ({name!r}) must be a non-empty string")
    _component = name


class ComponentMetric:
    """A metric with a ``component`` label that is always this process's name: ``set``,
    ``inc``, ``observe``... go to that child, so call sites read as for an unlabelled metric."""

    def __init__(self, metric):
        self.metric = metric

    def __getattr__(self, attr: str):
        return getattr(self.metric.labels(component=_component), attr)


# -- every process -----------------------------------------------------------------------------
REJECTED_FRAMES = Counter(
    "asyncrl_rejected_frames", "Frames rejected by a receiver, by reason.", ["socket", "reason"], registry=REGISTRY
)
POLICY_VERSION = ComponentMetric(
    Gauge(
        "asyncrl_policy_version",
        "Policy version a process holds (learner), serves (generator) or last heard of (buffer).",
        ["component"],
        registry=REGISTRY,
    )
)
BUSY_SECONDS = ComponentMetric(
    Counter(
        "asyncrl_busy_seconds",
        "Seconds spent on the work the process exists for (sampling, optimizer steps); its rate is the busy fraction.",
        ["component"],
        registry=REGISTRY,
    )
)
SAMPLES = Counter("asyncrl_samples", "Samples passing this process, by outcome.", ["outcome"], registry=REGISTRY)
DROPPED = Counter("asyncrl_dropped", "Samples dropped, by reason.", ["reason"], registry=REGISTRY)

# -- generators --------------------------------------------------------------------------------
ROLLOUT_SECONDS = Histogram(
    "asyncrl_rollout_latency_seconds",
    "Seconds from the start of sampling a batch to its groups being ready, per group.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter(
    "asyncrl_generated_tokens", "Response tokens generated (sent on to the reward workers).", registry=REGISTRY
)

EPISODE_TURNS = Histogram(
    "asyncrl_episode_turns",
    "Model turns of each multi-turn episode sent (environment.cls).",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
    registry=REGISTRY,
)
EPISODE_TOKENS = Counter(
    "asyncrl_episode_tokens",
    "Tokens of the multi-turn episodes sent, by whose they are: the model's (trained) or the environment's (masked).",
    ["side"],
    registry=REGISTRY,
)
TOOL_CALLS = Counter(
    "asyncrl_tool_calls", "Tool calls in the episodes sent, by outcome (ok or error).", ["outcome"], registry=REGISTRY
)
ENVIRONMENT_FAILURES = Counter(
    "asyncrl_environment_failures",
    "Episodes whose environment failed (raised or timed out): sent unscored, with the reason.",
    ["reason"],
    registry=REGISTRY,
)

EVAL_PROMPTS = Counter(
    "asyncrl_eval_prompts", "Held-out prompts a generator answered for evaluation (not samples).", registry=REGISTRY
)
EVAL_SECONDS = Counter(
    "asyncrl_eval_seconds", "Seconds a generator spent decoding held-out prompts for evaluation.", registry=REGISTRY
)

# -- controller --------------------------------------------------------------------------------
EVAL_EXACT_MATCH = Gauge(
    "asyncrl_eval_exact_match",
    "Held-out exact match (greedy, by the generators' engines) of the last evaluation.",
    registry=REGISTRY,
)
EVAL_VERSION = Gauge(
    "asyncrl_eval_version", "Learner version at which the last held-out evaluation was asked.", registry=REGISTRY
)

# -- learner -----------------------------------------------------------------------------------
LEARNER_STEP_SECONDS = Histogram(
    "asyncrl_learner_step_duration_seconds",
    "Seconds per learner optimizer step.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
STALENESS = Histogram(
    "asyncrl_staleness",
    "Staleness of trained samples in versions: learner version at the update minus the sampling version.",
    buckets=VERSION_BUCKETS,
    registry=REGISTRY,
)
LAST_STEP_TIMESTAMP = Gauge(
    "asyncrl_last_step_timestamp_seconds",
    "Unix time of the learner's last optimizer step (alert when time() minus it grows).",
    registry=REGISTRY,
)
MISMATCH_KL = Gauge(
    "asyncrl_mismatch_kl",
    "KL between the behaviour (sampler) and the learner's logprobs on samples of staleness 0, last step.",
    registry=REGISTRY,
)
CLIP_FRACTION = Gauge(
    "asyncrl_clip_fraction",
    "Share of the last step's kept tokens a clip of the policy loss acted on, by side: high (the ratio cut at "
    "its ceiling), low (at its floor), dual (the dual clip's bound on a negative advantage).",
    ["side"],
    registry=REGISTRY,
)
PPO_KL = Gauge(
    "asyncrl_ppo_kl",
    "Mean of -log(pi_theta / anchor) over the last step's kept tokens: how far the updates moved the policy.",
    registry=REGISTRY,
)

BEHAVIOUR_ESS = Gauge(
    "asyncrl_behaviour_ess",
    "Effective sample size (Σw)² / (N·Σw²) of the last step's raw importance weights pi_prox / mu, in (0, 1].",
    registry=REGISTRY,
)
STALENESS_BOUND = Gauge(
    "asyncrl_staleness_bound",
    "The staleness bound under buffer.max_staleness auto: set by the learner, applied by the buffer's gate.",
    ["component"],
    registry=REGISTRY,
)
STALENESS_BOUND_CHANGES = Counter(
    "asyncrl_staleness_bound_changes",
    "Changes of the staleness bound under buffer.max_staleness auto, by direction (raise, lower).",
    ["direction"],
    registry=REGISTRY,
)
PARTIAL_ROLLOUTS = Counter(
    "asyncrl_partial_rollouts",
    "Partial rollouts (generator.partial_rollouts): answers resumed under a newer version (generators), "
    "tokens masked out of the loss as too stale and samples left with none trained (learner).",
    ["what"],
    registry=REGISTRY,
)


def record_learner_step(stats: StepStats) -> None:
    """The per-step gauges: when the step ended, the sampler-vs-learner mismatch KL when the
    trainer measured it (only on batches with on-policy samples), the clip fractions by side
    and the PPO KL when the trainer reports them."""
    LAST_STEP_TIMESTAMP.set(time.time())
    if stats.mismatch_kl is not None:
        MISMATCH_KL.set(stats.mismatch_kl)
    for side, value in (("high", stats.clipfrac_high), ("low", stats.clipfrac_low), ("dual", stats.clipfrac_dual)):
        if value is not None:
            CLIP_FRACTION.labels(side).set(value)
    if stats.ppo_kl is not None:
        PPO_KL.set(stats.ppo_kl)


# -- reward workers ------------------------------------------------------------------------------
REWARD_SECONDS = Histogram(
    "asyncrl_reward_group_duration_seconds",
    "Seconds to score one group with every reward.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
REWARD_LATENCY = Histogram(
    "asyncrl_reward_duration_seconds",
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
REWARD_MISMATCHED = Counter(
    "asyncrl_reward_mismatched_replies",
    "Replies that echoed the id of another request (a shuffled or cached reply), rejected and retried, by reward.",
    ["reward"],
    registry=REGISTRY,
)
REWARD_UNSCORED = Counter(
    "asyncrl_reward_unscored_samples",
    "Samples a reward left unscored, by reason.",
    ["reward", "reason"],
    registry=REGISTRY,
)
BREAKER_STATE = Gauge(
    "asyncrl_reward_breaker_state",
    "Circuit breaker of an HTTP reward: 0 closed, 1 half open (one probe call), 2 open (calls fail at once).",
    ["reward"],
    registry=REGISTRY,
)
BREAKER_TRANSITIONS = Counter(
    "asyncrl_reward_breaker_transitions",
    "Circuit breaker transitions of an HTTP reward, by the state entered (open, half_open, closed).",
    ["reward", "state"],
    registry=REGISTRY,
)
BREAKER_RECOVERY = Histogram(
    "asyncrl_reward_breaker_recovery_seconds",
    "Seconds from a circuit breaker's opening to its closing again (an outage as the client saw it).",
    ["reward"],
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
    registry=REGISTRY,
)
REWARD_RATE_SHARE = Gauge(
    "asyncrl_reward_rate_share",
    "This reward worker's share of a rate budget shared by every worker calling one API with one key "
    "(budget: a hash of the key's variable name and the host), by limit: concurrency, rpm, tpm.",
    ["budget", "limit"],
    registry=REGISTRY,
)
REWARD_QUEUE_DEPTH = Gauge(
    "asyncrl_reward_queue_groups", "Groups waiting in a reward worker, by state.", ["state"], registry=REGISTRY
)

# -- replay buffer -----------------------------------------------------------------------------
BUFFER_SAMPLES = Gauge("asyncrl_buffer_items", "Samples held by the replay buffer.", registry=REGISTRY)
BUFFER_GROUPS = Gauge("asyncrl_buffer_groups", "Groups held by the replay buffer.", registry=REGISTRY)
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
ZERO_VARIANCE_GROUPS = Counter(
    "asyncrl_zero_variance_groups",
    "Groups the buffer dropped because every answer scored alike (buffer.zero_variance), by that shared reward.",
    ["reward"],
    registry=REGISTRY,
)
BUFFER_SAMPLE_AGE_VERSIONS = Histogram(
    "asyncrl_buffer_sample_age_versions",
    "Learner version minus the group's policy version when the buffer hands it out.",
    buckets=VERSION_BUCKETS,
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

# -- weight sync -------------------------------------------------------------------------------
WEIGHT_SYNC_SECONDS = Histogram(
    "asyncrl_weight_sync_duration_seconds",
    "Seconds of one weight update, by stage: publish (learner: gather, pack, send or write) and "
    "apply (generator: receive, verify, load, probe).",
    ["stage"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
WEIGHT_BROADCAST_SECONDS = WEIGHT_SYNC_SECONDS.labels(stage="publish")
WEIGHT_APPLY_SECONDS = WEIGHT_SYNC_SECONDS.labels(stage="apply")
WEIGHT_BYTES = Counter(
    "asyncrl_weight_bytes", "Bytes of weights published (learner) or received (generator).", registry=REGISTRY
)
WEIGHT_SERVED_SECONDS = Histogram(
    "asyncrl_weight_served_seconds",
    "Seconds from the learner starting to publish a version to a generator serving it (stage total), "
    "and the stages of that time (asyncrl.weights.timeline): learner_probe, gather, transport_out, "
    "transport_in, wait, reload, probe. Observed by the controller, one per version and generator.",
    ["stage"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
WEIGHT_FAILURES = Counter(
    "asyncrl_weight_failures",
    "Weight updates that failed, by stage (receive: checksum, order, timeout; apply: load, probe; send: stalled subscriber).",
    ["stage"],
    registry=REGISTRY,
)


# -- GPU memory ----------------------------------------------------------------------------------
class GPUMemoryCollector:
    """``asyncrl_gpu_memory_{allocated,reserved,total}_bytes{device}``, read at scrape time, only in
    a process that has imported torch and initialised CUDA: a scrape must neither import torch
    into a process that does not use it nor create a CUDA context."""

    def collect(self):
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        allocated = GaugeMetricFamily(
            "asyncrl_gpu_memory_allocated_bytes", "GPU memory held by tensors, by device.", labels=["device"]
        )
        reserved = GaugeMetricFamily(
            "asyncrl_gpu_memory_reserved_bytes",
            "GPU memory reserved by the caching allocator, by device.",
            labels=["device"],
        )
        total = GaugeMetricFamily("asyncrl_gpu_memory_total_bytes", "GPU memory of the device.", labels=["device"])
        for index in range(torch.cuda.device_count()):
            device = str(index)
            allocated.add_metric([device], torch.cuda.memory_allocated(index))
            reserved.add_metric([device], torch.cuda.memory_reserved(index))
            total.add_metric([device], torch.cuda.get_device_properties(index).total_memory)
        yield from (allocated, reserved, total)

    def describe(self):
        return []  # no collect() at registration: families appear only once CUDA is up


REGISTRY.register(GPUMemoryCollector())


# -- serving -------------------------------------------------------------------------------------
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
_servers: dict[str, WSGIServer] = {}  # name -> its endpoint, for stop_metrics


def serve_metrics(run_dir: str | Path | None, name: str) -> int:
    """Serve ``/metrics`` and ``/health`` on 127.0.0.1 at a free port, in a daemon thread; name
    this process ``name`` in the ``component`` label; record the port (when there is a run
    directory); return it."""
    set_component(name)
    server = make_server("127.0.0.1", 0, metrics_app, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    _servers[name] = server
    port = server.server_port
    if run_dir is not None:
        path = Path(run_dir) / "metrics" / f"{name}.port"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(port))
    return port


def stop_metrics(name: str) -> None:
    """Stop serving ``name``'s endpoint (a process that outlives its run, e.g. a test running a
    controller in-process); component processes just exit."""
    server = _servers.pop(name, None)
    if server is not None:
        server.shutdown()
        server.server_close()


def write_metrics_snapshot(run_dir: str | Path, name: str) -> Path:
    """Write the registry in the text exposition format to ``run_dir/metrics/{name}.prom``
    (at exit, so the last values outlive the process and its port)."""
    path = Path(run_dir) / "metrics" / f"{name}.prom"
    path.write_bytes(generate_latest(REGISTRY))
    return path
