"""``asyncrl plot RUN_DIR``: a run's curves as one PNG, from ``steps.jsonl`` and ``summary.json``.

Panels: (1) mean reward and accuracy per learner step (accuracy: the share of the batch a
correctness reward scored right), with held-out exact match before and after when the run
evaluated; (2) the staleness histogram of trained samples (from the summary, or, for a run still
going, from the learner's ``asyncrl_staleness`` histogram, live or last exported); (3) throughput
over wall time since go: trained samples/s and tokens/s between consecutive steps. The x axis of
the reward curve is the learner version, which only grows, however asynchronous the run.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from asyncrl.configbase import UserFileError
from asyncrl.observability.step_stats import StepStats


def load_steps(run_dir: Path) -> list[tuple[float, StepStats]]:
    """Each line of ``steps.jsonl``: (``t``, seconds since go; its ``StepStats``)."""
    path = run_dir / "steps.jsonl"
    if not path.exists():
        raise UserFileError(f"{path} is missing: is {run_dir} a run directory with at least one learner step?")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["t"], StepStats.from_record(r)) for r in records]


def staleness_histogram(run_dir: Path, summary: dict) -> dict[int, float]:
    """Staleness -> trained samples: the summary's, else the learner's exported histogram."""
    if summary.get("staleness_hist"):
        return {int(k): v for k, v in summary["staleness_hist"].items()}
    from asyncrl.observability.inspect_run import learner_exposition

    text = learner_exposition(run_dir)
    if text is None:
        return {}
    cumulative = []
    for family in text_string_to_metric_families(text):
        if family.name == "asyncrl_staleness":
            cumulative = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
    hist, below = {}, 0.0
    for le, count in sorted(cumulative):  # buckets are integer versions: le=k holds staleness k
        if le != float("inf") and count > below:
            hist[int(le)] = count - below
        below = max(below, count)
    return hist


def throughput(steps: list[tuple[float, StepStats]]) -> tuple[list[float], list[float], list[float]]:
    """(time, samples/s, tokens/s) of each step's interval since the previous step (or since go)."""
    times, samples, tokens = [], [], []
    previous = 0.0
    for t, s in steps:
        dt = t - previous
        previous = t
        if dt <= 0:
            continue
        times.append(t)
        samples.append((s.samples or 0) / dt)
        tokens.append(s.tokens / dt)
    return times, samples, tokens


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps = load_steps(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    versions = [s.version for _, s in steps]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))

    ax1.plot(versions, [s.reward for _, s in steps], label="mean reward of the batch")
    accuracy = [(s.version, s.accuracy) for _, s in steps if s.accuracy is not None]
    if accuracy:
        ax1.plot(*zip(*accuracy), label="accuracy of the batch")
    if summary.get("eval_before") is not None:
        ax1.scatter(
            [0, versions[-1]],
            [summary["eval_before"], summary["eval_after"]],
            color="k",
            zorder=3,
            label="held-out exact match",
        )
    ax1.set_xlabel("learner version")
    ax1.set_title("reward and accuracy")
    ax1.legend()

    hist = staleness_histogram(run_dir, summary)
    ax2.bar(list(hist), list(hist.values()))
    ax2.set_xlabel("staleness (versions)")
    ax2.set_title("trained samples by staleness")

    times, samples, tokens = throughput(steps)
    ax3.plot(times, samples, label="trained samples/s")
    ax3.set_xlabel("seconds since go")
    ax3.set_ylabel("samples/s")
    ax3.set_title("throughput")
    if any(t == t for t in tokens):  # not all NaN: the steps carry token counts
        twin = ax3.twinx()
        twin.plot(times, tokens, color="tab:orange", label="trained tokens/s")
        twin.set_ylabel("tokens/s")
        twin.legend(loc="upper right")
    ax3.legend(loc="upper left")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "plots.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
