"""The long-tailed answer-length workload the vLLM benchmarks share.

Reasoning models answer with lengths that spread over orders of magnitude; a batch barrier then
leaves the engine nearly empty while the last answers finish. The benchmarks make that tail real
on a model with random weights: each group's answers are exactly L tokens long (``min_tokens =
max_tokens = L`` with ``ignore_eos``), L drawn per group from a lognormal

    L = clip(round(median · exp(σ · z)), 1, cap),   z ~ N(0, 1)

(median 32, σ = 1, cap 512: mean ≈ 52, 1 % of groups past ≈ 330). ``bench/generation.py`` (one
engine, continuous vs batch) and ``asyncrl.benchmarks.vllm_modes`` (the pipeline's four
combinations) draw the same lengths and prompts from the same seed.

>>> draw_lengths(4, seed=0)
[36, 28, 61, 36]
>>> addition_prompts(2, seed=0)
['52+56=', '77+95=']
"""

from __future__ import annotations

import numpy as np

MEDIAN, SIGMA, CAP = 32, 1.0, 512
"""The lognormal's median and σ (of log L), and the longest answer (tokens)."""


def draw_lengths(groups: int, seed: int, median: int = MEDIAN, sigma: float = SIGMA, cap: int = CAP) -> list[int]:
    """Answer length of each of ``groups`` groups: lognormal (``median``, ``sigma``), within [1, ``cap``]."""
    if groups < 0 or median < 1 or sigma < 0 or cap < 1:
        raise ValueError(f"groups ({groups}) >= 0, median ({median}) >= 1, sigma ({sigma}) >= 0, cap ({cap}) >= 1")
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.round(median * np.exp(sigma * rng.standard_normal(groups))), 1, cap)]


def addition_prompts(groups: int, seed: int) -> list[str]:
    """One two-digit addition prompt per group (the tiny model's character vocabulary)."""
    rng = np.random.default_rng(seed + 1)
    return [f"{a}+{b}=" for a, b in rng.integers(10, 100, size=(groups, 2))]


def describe() -> str:
    return f"lognormal median {MEDIAN}, sigma {SIGMA}, cap {CAP}; min_tokens = max_tokens, ignore_eos"
