"""The list of every Prometheus metric, generated from the registry the processes serve."""

from __future__ import annotations

import importlib

# Modules that define metrics at import; all of them register in asyncrl.observability.metrics.REGISTRY.
METRIC_MODULES = ("asyncrl.observability.metrics", "asyncrl.wire.socketwatch")


def metric_rows() -> list[tuple[str, str, str]]:
    """(name with its labels, type, help text) of every metric, in registration order."""
    modules = [importlib.import_module(name) for name in METRIC_MODULES]
    registry = modules[0].REGISTRY
    rows = []
    for collector in list(registry._collector_to_names):
        kind = getattr(collector, "_type", None)
        if kind is None:
            continue  # a custom collector (GPU memory): its metrics exist only where CUDA does
        name = collector._name + ("_total" if kind == "counter" else "")
        labels = "{" + ",".join(collector._labelnames) + "}" if collector._labelnames else ""
        rows.append((name + labels, kind, " ".join(collector._documentation.split())))
    return rows


def render() -> str:
    lines = ["| metric | type | help |", "| --- | --- | --- |"]
    pipe = "\\|"  # a pipe in a help text must not split the table's cell
    lines += [f"| `{name}` | {kind} | {doc.replace('|', pipe)} |" for name, kind, doc in metric_rows()]
    return "\n".join(lines) + "\n"
