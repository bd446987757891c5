"""The benchmark's record: each run, and per side the figures the comparison is made on.

The comparison is seed by seed against trl's run of the same seed: the time asyncrl took to reach
the held-out accuracy trl ended with, as a fraction of trl's whole command. Medians over seeds
sit beside the seed spread (min, max) so a difference inside the spread reads as one.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path

from asyncrl.benchmarks.vs_trl.runs import SideRun


def spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def compare(runs: list[SideRun]) -> dict:
    """Per side: accuracy before/after, command and first-step seconds, samples/s, tokens/s; per
    asyncrl side against trl (same seed): the seconds to trl's final accuracy and their ratio to
    trl's command seconds (None where it was never reached)."""
    sides = sorted({r.side for r in runs})
    trl = {r.seed: r for r in runs if r.side == "trl"}
    out = {}
    for side in sides:
        mine = [r for r in runs if r.side == side]
        figures = {
            "seeds": [r.seed for r in mine],
            "accuracy_before": spread([r.curve[0].accuracy for r in mine]),
            "accuracy_after": spread([r.final for r in mine]),
            "command_s": spread([r.command_s for r in mine]),
            "first_step_s": spread([r.first_step_s for r in mine]),
            "train_s": spread([r.train_s for r in mine]),
            "samples_per_s": spread([r.samples_per_s() for r in mine]),
            "trained_tokens_per_s": spread([r.tokens_per_s() for r in mine]),
        }
        if side != "trl" and trl:
            to_trl = {r.seed: r.time_to(trl[r.seed].final) for r in mine if r.seed in trl}
            figures["s_to_trl_final_accuracy"] = to_trl
            figures["s_to_trl_final_over_trl_command_s"] = spread(
                [t / trl[seed].command_s if t is not None else None for seed, t in to_trl.items()]
            )
            figures["reached_trl_final"] = sum(t is not None for t in to_trl.values())
            figures["command_s_over_trl"] = spread([r.command_s / trl[r.seed].command_s for r in mine if r.seed in trl])
        out[side] = figures
    return out


def record(workload, runs: list[SideRun], machine: dict) -> dict:
    return {
        "benchmark": "vs_trl",
        "workload": workload.name,
        "about": workload.about,
        "recipe": workload.recipe,
        "overrides": list(workload.overrides),
        "machine": machine,
        "comparison": compare(runs),
        "runs": [asdict(r) for r in runs],
    }


def plot(runs: list[SideRun], path: Path, title: str) -> None:
    """Held-out accuracy against seconds from the command's launch, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"trl": "tab:red", "async": "tab:blue", "sync": "tab:green"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        ax.plot(
            [p.t for p in r.curve],
            [p.accuracy for p in r.curve],
            marker="o",
            markersize=3,
            color=colors.get(r.side, "black"),
            alpha=0.8,
            label=f"{r.side} (seed {r.seed})",
        )
        ax.axvline(r.command_s, color=colors.get(r.side, "black"), alpha=0.25, linestyle=":")
    ax.set_xlabel("seconds from the command (dotted: the command's end)")
    ax.set_ylabel("held-out exact match (greedy)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
