"""``RUN_DIR/prometheus.yml``: a Prometheus scrape job over the metrics port of every process of a
run (each one writes ``RUN_DIR/metrics/NAME.port``, ``asyncrl.observability.metrics``). Written
once every process is ready, and again when a process joins the run by address."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_scrape_config(run_dir: Path) -> Path:
    """Write ``RUN_DIR/prometheus.yml`` for every metrics port written so far; returns its path."""
    targets = [
        {"targets": [f"127.0.0.1:{port.read_text().strip()}"], "labels": {"component": port.stem}}
        for port in sorted((run_dir / "metrics").glob("*.port"))
    ]
    scrape = {
        "scrape_configs": [{"job_name": f"asyncrl-{run_dir.name}", "scrape_interval": "5s", "static_configs": targets}]
    }
    path = run_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(scrape, sort_keys=False))
    return path
