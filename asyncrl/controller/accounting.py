"""The run's summary, built from each process's final report, and the ledger check.

Every sample a generator produced ends in exactly one place:

    generated = trained + Σ dropped[reason] + buffered_at_end + in_flight_at_end

where each term is counted by the process that holds it (learner, generators and buffer for
drops, buffer, generators and reward workers for what they still hold), never derived from the
others, so the equation is a real check that nothing was lost or duplicated.

When the buffer hands a group out more than once (``buffer.max_times_sampled != 1``), each
sample still counts once: ``trained`` is samples trained at least once (the learner counts by
uid), matched by the buffer's first hand-outs (``sampled``); repeats are reported beside it
(``trained_with_reuse``, matched by the buffer's ``sampled + resampled``).

With ``buffer.zero_variance.drop`` the groups whose answers all scored alike are one of the drop
reasons (``zero_variance``); ``zero_variance`` beside them gives the filter's counts in groups, by
the reward they shared, and the share of the samples reaching the buffer that it dropped.

Under partial rollouts (``generator.partial_rollouts``) a sample whose every token was past the
staleness bound when its group was trained is counted by the learner as dropped, ``stale``;
``partial_rollouts`` reports those, the tokens kept as context only, and the answers resumed under
a newer version. ``staleness_hist`` (samples by the staleness of their oldest trained token),
``token_staleness_hist`` (tokens by the staleness of the version that sampled each) and
``versions_per_sample`` (samples by the exact number of versions that sampled them) describe what
was trained.
"""

from __future__ import annotations

from collections import Counter

from asyncrl.wire.messages import BufferFinal, FinalReport, GeneratorFinal, LearnerFinal, RewardFinal


def summarize(
    finals: dict[str, FinalReport], wall_s: float, eval_before: float | None, eval_after: float | None
) -> dict:
    """``finals`` maps process name -> its final report (``asyncrl.wire.finals``: one type per role)."""
    gens = [f for f in finals.values() if isinstance(f, GeneratorFinal)]
    rewards = [f for f in finals.values() if isinstance(f, RewardFinal)]
    buffer = next(f for f in finals.values() if isinstance(f, BufferFinal))
    learner = next(f for f in finals.values() if isinstance(f, LearnerFinal) and not f.rank)  # rank 0's
    dropped: Counter[str] = Counter()
    for g in gens:
        dropped.update(g.dropped)
    dropped.update(buffer.dropped)
    dropped.update(learner.dropped)
    generated = sum(g.generated for g in gens)
    in_flight = sum(g.held for g in gens) + sum(r.held for r in rewards) + learner.held
    # What left one process and did not reach the next, per link: 0 after a drained stop; a
    # positive number is a loss (or a frame still in a socket), a negative one a duplicate.
    unaccounted = {
        "generators->rewards": generated
        - sum(dropped_by(g) for g in gens)
        - sum(g.held for g in gens)
        - sum(r.received for r in rewards),
        "rewards->buffer": sum(r.forwarded for r in rewards) - buffer.inserted,
        "buffer->learner": buffer.sampled - learner.trained - learner.held - dropped_by(learner),
        "buffer->learner (with reuse)": buffer.sampled
        + buffer.resampled
        - learner.trained_with_reuse
        - learner.held
        - dropped_by(learner),
    }
    tokens = sum(g.tokens for g in gens)
    summary = {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "learner_steps": learner.version,
        "generated": generated,
        "trained": learner.trained,
        "trained_with_reuse": learner.trained_with_reuse,
        "dropped": dict(dropped),
        "buffered_at_end": buffer.held,
        "in_flight_at_end": in_flight,
        "staleness_hist": learner.staleness_hist,
        "token_staleness_hist": learner.token_staleness_hist,
        "versions_per_sample": versions_per_sample(learner.segments_hist),
        "partial_rollouts": {
            "resumed": sum(g.resumed for g in gens),
            "stale_tokens_masked": learner.stale_tokens_masked,
            "stale_samples_dropped": learner.dropped.get("stale", 0),
        },
        "latency_s": learner.latency_s,
        "trained_tokens": learner.trained_tokens,
        "generator_busy_fraction": sum(g.busy_s for g in gens) / max(sum(g.wall_s for g in gens), 1e-9),
        "learner_busy_fraction": learner.busy_s / max(learner.wall_s, 1e-9),
        "tokens_per_s": tokens / max(wall_s, 1e-9),
        "wall_s": wall_s,
        "unaccounted_by_link": unaccounted,
        "rejected_frames": buffer.rejected_frames + sum(r.rejected_frames for r in rewards),
    }
    if (zero_variance := buffer.zero_variance) is not None:
        summary["zero_variance"] = {**zero_variance, "fraction": zero_variance["samples"] / max(buffer.inserted, 1)}
    summary["reconciles"] = summary["generated"] == (
        summary["trained"] + sum(dropped.values()) + summary["buffered_at_end"] + summary["in_flight_at_end"]
    )
    return summary


def dropped_by(final: GeneratorFinal | LearnerFinal) -> int:
    return sum(final.dropped.values())


def versions_per_sample(segments_hist: dict) -> dict[str, int]:
    """Samples trained by exactly how many policy versions sampled them: ``{"1": ..., "2": ...,
    "5": ...}`` (more than 1: weight updates came while the answer was being sampled).

    "1" and "2" are always there, larger counts when some sample had them, keys in numeric order.
    Bounded: every version a sample spans sampled at least one of its tokens, so there are at
    most ``sampling.max_tokens`` keys (in practice about as many as the learner steps one long
    answer lasts).

    >>> versions_per_sample({"1": 6, "4": 1})
    {'1': 6, '2': 0, '4': 1}
    """
    out = Counter({1: 0, 2: 0})
    for k, n in segments_hist.items():
        out[int(k)] += n
    return {str(k): out[k] for k in sorted(out)}
