"""``asyncrl plot RUN_DIR``: a run's curves as one PNG, from ``steps.jsonl`` and ``summary.json``.

Panels: mean reward per learner step (with held-out exact match before and after, when the run
evaluated), the staleness histogram of trained samples, and training throughput over time
(samples per second of each step's interval since the previous one). The x axis of the curves is
the learner version, which only grows, however asynchronous the run.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "steps.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a run directory with at least one learner step?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps = load_steps(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    versions = [s["version"] for s in steps]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))

    ax1.plot(versions, [s["reward"] for s in steps], label="mean reward of the batch")
    if summary.get("eval_before") is not None:
        ax1.scatter(
            [0, versions[-1]],
            [summary["eval_before"], summary["eval_after"]],
            color="k",
            zorder=3,
            label="held-out exact match",
        )
    ax1.set_xlabel("learner version")
    ax1.set_title("reward")
    ax1.legend()

    hist = {int(k): v for k, v in summary.get("staleness_hist", {}).items()}
    ax2.bar(list(hist), list(hist.values()))
    ax2.set_xlabel("staleness (versions)")
    ax2.set_title("trained samples by staleness")

    times = [s["t"] for s in steps]
    rates = [s["samples"] / max(t1 - t0, 1e-9) for s, t0, t1 in zip(steps[1:], times, times[1:])]
    ax3.plot(versions[1:], rates)
    ax3.set_xlabel("learner version")
    ax3.set_title("trained samples / s")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "plots.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
