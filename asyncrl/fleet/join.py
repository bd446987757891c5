"""Processes that join a running run by address: ``asyncrl generator --connect RUN_DIR|ADDRESS``
and ``asyncrl reward-worker --connect RUN_DIR|ADDRESS``.

Each reads the run's resolved config and endpoints from the run directory, or asks the run's
first reward worker for them at its ``reward_share`` address (``fetch_run``), then runs the same
loop as the controller's own processes of its role. A run with ``security.curve`` on is joined
with this host's keys: ``security.curve=true security.keys_dir=DIR security.client_key=NAME``
(a client pair the run authorised, ``asyncrl keys DIR --clients NAME``); by address the request
for the run's config already goes over CURVE (``join_context``). The controller hears its events like any
process's, so its final counts enter the run's accounting. The controller cannot see such a
process die: each sends a heartbeat every ``HEARTBEAT_S`` from a thread of its own (on its own
socket), and the controller takes ``supervision.joined_timeout_s`` of silence for a death
(``asyncrl.controller.supervision``): what the process held is handed out again.

A joined generator takes prompts from the dispatcher (which admits by the same staleness budget,
whoever asks), sends groups to the reward workers, and loads the newest published weights before
each batch. It stops with the run's "stop", or on SIGTERM/SIGINT after the batch it is sampling
(nothing half-sampled is lost). A joined reward worker asks the run's first reward worker for
groups to score (``asyncrl.rewards.process``).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from asyncrl.config import RunConfig, load_run_config
from asyncrl.configbase import apply_overrides
from asyncrl.fleet import malloc_trim
from asyncrl.fleet.context import ProcessContext, configure_process
from asyncrl.models.fetch import resolve_model_path
from asyncrl.wire import security
from asyncrl.wire.endpoints import Endpoints
from asyncrl.wire.messages import HeartbeatEvent, Run, WantRun
from asyncrl.wire.sockets import RequestClient, StreamSender

log = logging.getLogger(__name__)

SECTIONS = ("generator.", "engine.", "sampling.")
"""The config sections a joining generator may override (the rest is the run's)."""
REWARD_SECTIONS = ("reward.",)
"""The config section a joining reward worker may override."""
SECURITY_KEYS = ("curve", "keys_dir", "client_key")
"""The ``security`` keys a joining process sets for itself: whether it speaks CURVE, where this
host's copy of the keys is, and which client pair it presents (the run's own paths are another
machine's)."""
HEARTBEAT_S = 2.0
"""Seconds between a joined process's heartbeats (``supervision.joined_timeout_s`` is many of them)."""


class JoinedContext(ProcessContext):
    """A process context that also stops when this process is told to leave by a signal, and
    sends the controller a heartbeat every ``HEARTBEAT_S`` until it is closed."""

    leaving = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._closing = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name=f"{self.name}.heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        """Heartbeats on a socket of this thread's own (a ZeroMQ socket belongs to one thread); a
        beat the controller does not take within a period is dropped: the next one follows."""
        sender = StreamSender(self.endpoints.events, name=f"{self.name}.heartbeat", hwm=4)
        try:
            while not self._closing.wait(HEARTBEAT_S):
                try:
                    sender.send(HeartbeatEvent(source=self.name, role=self.role), timeout=HEARTBEAT_S)
                except TimeoutError:
                    pass
        finally:
            sender.close()

    def stop_requested(self) -> bool:
        return self.leaving or super().stop_requested()

    def close(self) -> None:
        self._closing.set()
        self._heartbeat.join(timeout=2 * HEARTBEAT_S + 1)
        super().close()


def fetch_run(address: str, timeout: float = 30.0) -> tuple[RunConfig, Endpoints]:
    """Ask the reward worker that owns a stream (its ``reward_share`` address) for the run's
    resolved config and endpoints; waits at most ``timeout`` seconds for its answer."""
    client = RequestClient(address, name="reward-worker.join")
    try:
        reply = client.request(WantRun(), timeout=timeout)
    finally:
        client.close()
    if reply is None or not isinstance(reply[1], Run):
        raise SystemExit(f"no reward worker answered at {address} within {timeout:.0f} s")
    return RunConfig(**reply[1].config), Endpoints(**reply[1].endpoints)


def split_security(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """This host's ``security.*`` settings (``SECURITY_KEYS`` only), and the other overrides."""
    own, rest = {}, []
    for override in overrides:
        key, _, value = override.partition("=")
        if not key.startswith("security."):
            rest.append(override)
            continue
        if key.removeprefix("security.") not in SECURITY_KEYS:
            raise SystemExit(f"override ({override}) may set only security.{{{', '.join(SECURITY_KEYS)}}} when joining")
        own[key.removeprefix("security.")] = value
    return own, rest


def join_context(role: str, name: str, connect: str, own_security: dict[str, str]) -> JoinedContext:
    """The context of a process joining the run at ``connect`` (a run directory or the owner's
    ``reward_share`` address), with this host's security settings over the run's: by address
    they are in force before the request for the run's config, so a CURVE run can be joined."""
    if "://" in connect:
        if own_security:
            security.configure(security.SecurityConfig(**own_security))
        cfg, endpoints = fetch_run(connect)
    else:
        cfg, endpoints = load_run_config(Path(connect) / "config.yaml"), Endpoints.load(Path(connect))
    if own_security:  # validated: a bad value is named as for any override
        mine = security.SecurityConfig(**{**cfg.security.model_dump(mode="json"), **own_security})
        cfg = cfg.model_copy(update={"security": mine})
    return JoinedContext(role, name, None if "://" in connect else connect, cfg, endpoints)


def starting_model(run_dir: Path | None, cfg: RunConfig) -> str:
    """The model a run's generators started from: recorded in ``RUN_DIR/model_dir``, else the
    warm-started or built model in ``RUN_DIR/model``, else ``model.path``; a simulated engine
    needs none. The newest published weights replace it before the first batch."""
    if cfg.simulation.generator is not None:
        return "none"
    if run_dir is not None:
        recorded = run_dir / "model_dir"
        if recorded.exists():
            return recorded.read_text().strip()
        for sub in ("warm", "base"):
            if (run_dir / "model" / sub / "config.json").exists():
                return str(run_dir / "model" / sub)
    if cfg.model.path is None:
        raise SystemExit("no starting model in the run directory and model.path is None: pass --model DIR")
    return str(resolve_model_path(cfg.model.path))  # a known model's name is its fetched folder


def run_joined_generator(connect: str, name: str, model: str | None, overrides: list[str]) -> int:
    """One more generator in the run at ``connect`` (its run directory or ``reward_share`` address)."""
    from asyncrl.generators.process import run_generator

    own_security, overrides = split_security(overrides)
    bad = [o for o in overrides if not o.startswith(SECTIONS)]
    if bad:
        raise SystemExit(f"overrides ({bad}) must be of the sections {SECTIONS}, e.g. engine.seed=7")
    configure_process()
    ctx = join_context("generator", name, connect, own_security)
    run_dir = None if "://" in connect else Path(connect)
    ctx.cfg = RunConfig(**apply_overrides(ctx.cfg.model_dump(mode="json"), overrides))
    model_dir = str(resolve_model_path(model)) if model else starting_model(run_dir, ctx.cfg)
    malloc_trim.start(name, ctx.cfg.run.malloc_trim_s)  # as in every process the controller starts

    def leave(signum, _frame):
        log.info("%s: signal %d: finishing its batch, then leaving", name, signum)
        ctx.leaving = True

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    if run_dir is not None:
        from asyncrl.observability.scrape import write_scrape_config

        write_scrape_config(run_dir)  # Prometheus scrapes the newcomer too
    try:
        run_generator(ctx, model_dir)
    finally:
        ctx.close()
    return 0


def run_joined_reward_worker(connect: str, name: str, overrides: list[str]) -> int:
    """One more reward worker in the run at ``connect`` (its run directory or ``reward_share``
    address): it asks the run's first reward worker for groups (``asyncrl.rewards.process``)."""
    from asyncrl.rewards.process import run_reward_worker

    own_security, overrides = split_security(overrides)
    bad = [o for o in overrides if not o.startswith(REWARD_SECTIONS)]
    if bad:
        raise SystemExit(f"overrides ({bad}) must be of the reward section (reward.key=value)")
    configure_process()
    ctx = join_context("reward", name, connect, own_security)
    ctx.cfg = RunConfig(**apply_overrides(ctx.cfg.model_dump(mode="json"), overrides))
    malloc_trim.start(name, ctx.cfg.run.malloc_trim_s)
    try:
        run_reward_worker(ctx, owner=False)
    finally:
        ctx.close()
    return 0
