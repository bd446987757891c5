"""``asyncrl inspect RUN_DIR``: the state of a live run, from each process's own endpoints.

For every process that wrote ``RUN_DIR/metrics/NAME.port`` it asks ``/health`` and ``/metrics``
(a second at most each) and prints one row: up or down, the policy version it holds or serves,
its sample counters by outcome and drops by reason, the buffer's size, and requests/rejects;
``--json`` prints the same as one JSON object, for scripts. A process that has exited shows as
down with the values it last exported (``NAME.prom``), when it wrote them. A first row, ``run``,
gives the last learner step (``steps.jsonl``: version, reward, accuracy, staleness, seconds since
it) and the run's status: ``done`` (``summary.json``), ``stopped`` before its end (Ctrl-C,
SIGTERM, an abort: the summary says why, and the ledger's groups in flight at the stop, sent
again by ``asyncrl train --resume``), ``live``, or ``down`` (no summary, no process answering: the
controller was killed). ``--samples N`` prints instead the last N
answers the learner trained on, with their prompts, rewards and versions (``samples.jsonl``).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from asyncrl.configbase import UserFileError
from asyncrl.observability.step_stats import StepStats, check_names

SHOWN = {
    "asyncrl_policy_version": "version",
    "asyncrl_buffer_groups": "buffer_groups",
    "asyncrl_buffer_items": "buffer_samples",
    "asyncrl_busy_seconds_total": "busy_s",
    "asyncrl_generated_tokens_total": "generated_tokens",
    "asyncrl_last_step_timestamp_seconds": "last_step_at",
    "asyncrl_mismatch_kl": "mismatch_kl",
}


RUN_STEP = check_names(("reward", "accuracy", "staleness_mean"), "inspect_run.RUN_STEP")
"""The last step's statistics the ``run`` row shows (when measured)."""


def scrape(port: int, path: str, timeout: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.read().decode()
    except OSError:
        return None


def summarize_exposition(text: str, component: str | None = None) -> dict:
    """The few numbers a person looks at first, from a Prometheus text exposition. Given the
    process's name, a sample labelled with another ``component`` is skipped: a registry shared by
    several roles in one interpreter (an embedded controller, a test) holds each role's gauge."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if component is not None and sample.labels.get("component", component) != component:
                continue
            if sample.name in SHOWN:
                out[SHOWN[sample.name]] = sample.value
            elif sample.name == "asyncrl_samples_total":
                out.setdefault("samples", {})[sample.labels["outcome"]] = sample.value
            elif sample.name == "asyncrl_dropped_total":
                out.setdefault("dropped", {})[sample.labels["reason"]] = sample.value
            elif sample.name == "asyncrl_rejected_frames_total":
                out["rejected_frames"] = out.get("rejected_frames", 0) + sample.value
    return out


def learner_exposition(run_dir: Path) -> str | None:
    """The learner's metrics: live from its endpoint, else its last snapshot, else None."""
    port_file = run_dir / "metrics" / "learner.port"
    text = scrape(int(port_file.read_text()), "/metrics") if port_file.exists() else None
    snapshot = run_dir / "metrics" / "learner.prom"
    if text is None and snapshot.exists():
        text = snapshot.read_text()
    return text


def run_row(run_dir: Path) -> dict:
    """The run as a whole: finished, stopped before its end or not, and its last learner step."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else None
    stopped = summary is not None and "stopped" in summary
    row: dict = {"finished": summary is not None and not stopped, "status": "live"}
    if summary is not None:
        row["status"] = "stopped" if stopped else "done"
        row["reconciles"] = summary.get("reconciles")
    if stopped:
        row["in_flight_at_stop"] = summary["ledger"]["in_flight_at_stop"]
        row["lost"] = summary["ledger"]["lost"]
        row["why"] = summary["stopped"]
    steps = run_dir / "steps.jsonl"
    lines = steps.read_text().splitlines() if steps.exists() else []
    if lines:
        last = StepStats.from_record(json.loads(lines[-1]))
        row["step"] = last.version
        for key in RUN_STEP:
            if (value := getattr(last, key)) is not None:
                row[key] = value
        row["since_last_step_s"] = time.time() - steps.stat().st_mtime
    return row


def inspect_run(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    ports = sorted((run_dir / "metrics").glob("*.port"))
    if not ports:
        raise UserFileError(f"{run_dir}/metrics has no *.port file: is it a run directory?")
    state = {"run": run_row(run_dir)}
    for port_file in ports:
        name = port_file.stem
        port = int(port_file.read_text())
        up = scrape(port, "/health") == "ok\n"
        text = scrape(port, "/metrics") if up else None
        snapshot = run_dir / "metrics" / f"{name}.prom"
        if text is None and snapshot.exists():
            text = snapshot.read_text()
        row = summarize_exposition(text, name) if text else {}
        # Every process registers every metric; show the gauges where they mean something.
        if not name.startswith("buffer"):
            row.pop("buffer_groups", None), row.pop("buffer_samples", None)
        if name.startswith(("dispatcher", "reward")):
            row.pop("version", None)
        if not name.startswith("generator"):
            row.pop("generated_tokens", None)
        if not name.startswith("learner"):
            row.pop("last_step_at", None), row.pop("mismatch_kl", None)
        if not row.get("busy_s"):
            row.pop("busy_s", None)
        if row.get("last_step_at"):  # a Unix time: shown as its age
            row["since_last_step_s"] = time.time() - row["last_step_at"]
        row.pop("last_step_at", None)
        state[name] = {"up": up, "port": port, **row}
    if state["run"]["status"] == "live" and not any(row["up"] for name, row in state.items() if name != "run"):
        state["run"]["status"] = "down"
    return state


def print_state(state: dict) -> None:
    run = state.get("run", {})
    status = run.get("status", "done" if run.get("finished") else "live")
    print(
        f"{'run':14s} {status:7s} "
        + "  ".join(f"{k}={_fmt(v)}" for k, v in run.items() if k not in ("finished", "status"))
    )
    for name, row in state.items():
        if name == "run":
            continue
        extras = {k: v for k, v in row.items() if k not in ("up", "port")}
        fields = "  ".join(f"{k}={_fmt(v)}" for k, v in extras.items())
        print(f"{name:14s} {'up  ' if row['up'] else 'DOWN'} :{row['port']:<6d} {fields}")


def _fmt(value) -> str:
    if isinstance(value, str | bool) or value is None:
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{int(v)}" for k, v in value.items()) + "}"
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def main(run_dir: str, as_json: bool, samples: int | None = None) -> None:
    """Print the run's state, or with ``samples`` its last that many trained answers
    (``asyncrl.observability.samples``; JSON lines with ``as_json``)."""
    if samples is not None:
        from asyncrl.observability.samples import FILE, format_samples, read_last

        if samples < 1:
            raise SystemExit(f"--samples ({samples}) must be >= 1")
        records = read_last(Path(run_dir), samples)
        if not records:
            print(f"{Path(run_dir) / FILE}: no samples yet (logging.samples_per_step writes them each learner step)")
        elif as_json:
            print("\n".join(json.dumps(r, ensure_ascii=False) for r in records))
        else:
            print(format_samples(records))
        return
    state = inspect_run(run_dir)
    if as_json:
        print(json.dumps(state, indent=2))
    else:
        print_state(state)
