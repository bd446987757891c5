"""What one evaluation round reports: greedy accuracy, completed correctness, mean@k and pass@k.

Each held-out prompt is answered once greedily and, with ``eval.samples_k`` = n > 0, n times
sampled; the run's own reward (``asyncrl.rewards.evaluation``) scores every answer, and an answer
is *correct* when its value is at least ``eval.correct_at``. Over the prompts of a set:

- ``exact_match``: the share of prompts whose greedy answer is correct (the name is historical:
  the eval reward decides, exact match only when that is the reward);
- ``completed``: the share of greedy answers that ended by themselves (finish reason ``stop``:
  EOS, a stop string or a stop token), and ``completed_accuracy``, the share of those that are
  correct. A truncated answer (``length``) is wrong for its length, not its reasoning: the two
  together say which;
- ``mean_at_k``: the mean correctness of the n sampled answers, averaged over prompts (pass@1's
  unbiased estimate);
- ``pass_at_k``: the chance that at least one of k = n samples is correct, and ``pass_at`` the
  same for every k in 1, 2, 4, ... below n, each by the unbiased estimator of Chen et al. (2021),
  "Evaluating Large Language Models Trained on Code", eq. 1 (``pass_at_k``);
- ``sampled_completed`` and ``sampled_completed_accuracy``: as for greedy, over the samples;
- ``unscored``: answers the reward could not score (a timeout, an error); they count as wrong.

When the prompts are played as episodes of an environment (``environment.cls``), beside the score:

- ``episode_turns``, ``episode_tool_calls``, ``episode_tool_errors``: the greedy episodes' mean
  model turns, tool calls, and tool calls that ended in an error observation, per episode (None
  when the generators did not send them: older ones);
- ``sampled_episode_turns``, ``sampled_episode_tool_calls``, ``sampled_episode_tool_errors``: the
  same over the sampled episodes;
- ``env_failures``: episodes, greedy and sampled, the environment failed (it raised or timed out;
  their answers are unscored, so wrong).

A prompt the reward cannot score at all (no reference answer for a reward that compares with one)
is left out of every share, as before rewards scored evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1):

        pass@k = 1 - C(n - c, k) / C(n, k)

    computed as 1 - Π_{i = n-c+1}^{n} (1 - k / i), which never forms the large binomials.

    >>> pass_at_k(4, 0, 2), pass_at_k(4, 4, 1), pass_at_k(4, 1, 2)
    (0.0, 1.0, 0.5)
    """
    if not 0 <= c <= n:
        raise ValueError(f"c ({c}) must be in [0, n ({n})]")
    if not 1 <= k <= n:
        raise ValueError(f"k ({k}) must be in [1, n ({n})]")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(n: int) -> list[int]:
    """The k reported by ``pass_at``: 1, 2, 4, ... below n, and n.

    >>> pass_ks(1), pass_ks(6), pass_ks(8)
    ([1], [1, 2, 4, 6], [1, 2, 4, 8])
    """
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


@dataclass
class PromptScore:
    """One prompt's answers as scored: each answer's reward value (None: unscored) and whether it
    ended by itself (finish reason ``stop``)."""

    task: str
    eval_set: str
    greedy: float | None
    greedy_ended: bool
    samples: list[float | None] = field(default_factory=list)
    samples_ended: list[bool] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    """Played as episodes: each answer's model turns, greedy first; empty otherwise (or not sent)."""
    tool_calls: list[int] = field(default_factory=list)
    """Each answer's tool calls, greedy first (as ``turns``)."""
    tool_errors: list[int] = field(default_factory=list)
    """Each answer's tool calls that ended in an error observation, greedy first (as ``turns``)."""
    env_failed: list[bool] = field(default_factory=list)
    """Played as episodes: whether the environment failed each answer's episode, greedy first."""


def _share(num: int, den: int) -> float | None:
    return num / den if den else None


def round_metrics(scores: list[PromptScore], correct_at: float, samples_k: int, episodes: bool = False) -> dict:
    """The figures of the module docstring over ``scores`` (one set, one task, or a round);
    ``episodes``: the prompts were played as episodes (then the episode figures too)."""

    def right(value: float | None) -> bool:
        return value is not None and value >= correct_at

    greedy = [right(s.greedy) for s in scores]
    ended = [s.greedy_ended for s in scores]
    out = {
        "exact_match": _share(sum(greedy), len(scores)),
        "completed": _share(sum(ended), len(scores)),
        "completed_accuracy": _share(sum(g for g, e in zip(greedy, ended) if e), sum(ended)),
        "unscored": sum((s.greedy is None) + sum(v is None for v in s.samples) for s in scores),
        "num_scored": len(scores),
    }
    if samples_k:
        sampled = [[right(v) for v in s.samples] for s in scores]
        flat = [(r, e) for s, rs in zip(scores, sampled) for r, e in zip(rs, s.samples_ended)]
        finished = [r for r, e in flat if e]
        pass_at = {
            str(k): _share(sum(pass_at_k(len(rs), sum(rs), k) for rs in sampled), len(scores)) if scores else None
            for k in pass_ks(samples_k)
        }
        out.update(
            samples_k=samples_k,
            mean_at_k=_share(sum(sum(rs) / len(rs) for rs in sampled if rs), len(scores)),
            pass_at_k=pass_at[str(samples_k)],
            pass_at=pass_at,
            sampled_completed=_share(len(finished), len(flat)),
            sampled_completed_accuracy=_share(sum(finished), len(finished)),
        )
    if episodes:
        out.update(episode_metrics(scores, samples_k))
    return out


def episode_metrics(scores: list[PromptScore], samples_k: int) -> dict:
    """The episode figures of the module docstring over ``scores`` (prompts played as episodes).

    >>> played = [PromptScore("guess", "test", 1.0, True, turns=[3], tool_calls=[2], tool_errors=[1], env_failed=[False]),
    ...           PromptScore("guess", "test", None, True, turns=[1], tool_calls=[0], tool_errors=[0], env_failed=[True])]
    >>> episode_metrics(played, 0)
    {'episode_turns': 2.0, 'episode_tool_calls': 1.0, 'episode_tool_errors': 0.5, 'env_failures': 1}
    """
    sent = [s for s in scores if s.turns]  # a generator that predates the figures sends none

    def mean(values: list[int]) -> float | None:
        return sum(values) / len(values) if values else None

    out = {
        f"episode_{name}": mean([getattr(s, name)[0] for s in sent]) for name in ("turns", "tool_calls", "tool_errors")
    }
    if samples_k:
        for name in ("turns", "tool_calls", "tool_errors"):
            out[f"sampled_episode_{name}"] = mean([v for s in sent for v in getattr(s, name)[1:]])
    out["env_failures"] = sum(sum(s.env_failed) for s in scores)
    return out


def empty_metrics(samples_k: int, episodes: bool = False) -> dict:
    """The figures of a round with no score (failed): every share None."""
    return {key: (None if key != "samples_k" else samples_k) for key in round_metrics([], 1.0, samples_k, episodes)}
