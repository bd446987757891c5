"""``summary.json``: what a run did, from the final reports of its processes
(``asyncrl.controller.accounting``), its ledger (``asyncrl.rundir.ledger``), its evaluations,
deaths, restores and checkpoints, and its memory and time figures.

``reconciles`` is the run's verdict: the ledger shows no sample lost or trained twice (nor
reused without a first training), and, for a run that stopped cleanly and was neither resumed
nor had a process die, the per-process counters agree too (counters cannot count what a killed process held; the ledger can, by id).

A run stopped before its end (Ctrl-C, SIGTERM, an abort) has no final reports, so no counters:
``write_stopped_summary`` writes what is true of it instead, why it stopped, the last step, the
checkpoints and the ledger's verdict, whose groups without an outcome were in flight at the stop
(``asyncrl.rundir.ledger_replay``). A resume removes that summary and writes the whole one at its end.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.controller.accounting import summarize
from asyncrl.controller.evaluation import Evaluations
from asyncrl.controller.phases import PhaseClock
from asyncrl.controller.reports import TrainingProgress
from asyncrl.controller.supervision import Supervisor
from asyncrl.observability.procmem import MemoryWatch, peak_rss_bytes
from asyncrl.rundir.ledger_replay import reconcile_ledger
from asyncrl.weights.timeline import PublicationTimeline, describe
from asyncrl.wire.messages import FinalReport, GeneratorFinal


def write_summary(
    run_dir: Path,
    samples_per_group: int,
    finals: dict[str, FinalReport],
    progress: TrainingProgress,
    evaluations: Evaluations,
    supervisor: Supervisor,
    checkpoints: list[int],
    resumed: bool,
    *,
    rl_wall_s: float,
    controller_cpu_s: float,
    total_wall_s: float,
    resources: dict,
    phases: PhaseClock | None = None,
) -> dict:
    """Build the summary, write ``RUN_DIR/summary.json`` and return it. ``rl_wall_s``: the RL
    phase without the evaluations that blocked it; ``resources``: ``resource_figures``;
    ``phases``: where the wall time went (``asyncrl.controller.phases``), up to this call."""
    summary = summarize(finals, rl_wall_s, evaluations.before, evaluations.after)
    summary["evals"] = evaluations.records
    summary["eval_prompts_answered"] = sum(f.eval_prompts for f in finals.values() if isinstance(f, GeneratorFinal))
    summary["controller_cpu_s"] = controller_cpu_s
    summary["train_wall_s"] = progress.done_at - progress.go_at  # steady state: from go to the last step
    summary["total_wall_s"] = total_wall_s
    if phases is not None:
        phases.lap("finish")
        summary["phases_s"] = phases.seconds
        summary["phase_parts_s"] = phases.parts
    summary["generator_versions"] = progress.generator_versions
    summary["checkpoints"] = checkpoints
    summary["deaths"] = supervisor.deaths
    summary["restores"] = supervisor.restores
    summary["ledger"] = reconcile_ledger(run_dir, samples_per_group)
    summary.update(resources)
    summary["counters_reconcile"] = summary["reconciles"]
    clean = not supervisor.deaths and not resumed
    summary["reconciles"] = ledger_reconciles(summary["ledger"]) and (summary["counters_reconcile"] or not clean)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def ledger_reconciles(ledger: dict) -> bool:
    """No group lost or trained twice, no repeat of a group never trained."""
    return ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["retrained_untrained"] == 0


def write_stopped_summary(
    run_dir: Path,
    samples_per_group: int,
    reason: str,
    progress: TrainingProgress,
    supervisor: Supervisor,
    checkpoints: list[int],
    *,
    total_wall_s: float,
) -> dict:
    """``summary.json`` of a run stopped before its end, after its ledger's ``stop`` line: why, the
    last learner step seen, the checkpoints, deaths, restores and the ledger's verdict.
    ``counters_reconcile`` is None: no process sent its final counters."""
    ledger = reconcile_ledger(run_dir, samples_per_group)
    summary = {
        "stopped": reason,
        "learner_steps": progress.version,
        "checkpoints": checkpoints,
        "deaths": supervisor.deaths,
        "restores": supervisor.restores,
        "total_wall_s": total_wall_s,
        "ledger": ledger,
        "counters_reconcile": None,
        "reconciles": ledger_reconciles(ledger),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def resource_figures(
    finals: dict[str, FinalReport], memory: MemoryWatch, progress: TrainingProgress, timeline: PublicationTimeline
) -> dict:
    """Memory and time figures of ``summary.json``: each process's peak RSS (its final report;
    the controller's own read here), the run's sampled total, learner step times, and the
    publication-to-served time of every version (``asyncrl.weights.timeline``)."""
    peaks = {name: f.peak_rss_bytes for name, f in sorted(finals.items())}
    peaks["controller"] = peak_rss_bytes()  # itself alone: its descendants are the processes above
    return {
        "peak_rss_bytes": peaks,
        **memory.summary(),
        "learner_step_s": describe(progress.step_seconds),
        "publication_to_served": timeline.summary(),
    }
