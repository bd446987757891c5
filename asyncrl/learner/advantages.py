"""Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath", section 4.1.2).

GRPO has no value network: the n answers sampled for one prompt are each other's baseline. A
sample's advantage is its reward relative to the group's mean, optionally in units of the group's
standard deviation, and every token of the answer gets that same advantage.
"""

from __future__ import annotations

import numpy as np
import torch


def grpo_advantages(
    rewards: np.ndarray | torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> np.ndarray | torch.Tensor:
    """Group-normalised advantages, one per sample.

    For the rewards r_1..r_n of the n samples of one group (one row)::

        A_i = (r_i - mean(r)) / (std(r) + eps)      if scale_by_std
        A_i =  r_i - mean(r)                        otherwise (Dr. GRPO, Liu et al. 2025)

    ``std`` is the population standard deviation (``unbiased=False``, divide by n, not n - 1), so a
    group with rewards [1, 0, 0, 1] has std 0.5 and advantages [1, -1, -1, 1] (up to ``eps``).
    A group whose rewards are all equal (all right or all wrong) has advantages 0: it carries no
    learning signal, and ``eps`` keeps the division finite. Dropping the std scaling removes
    the bias towards groups that are almost all right or all wrong (whose small std inflates A).

    Args:
        rewards: (G, n) rewards of G groups of n samples; numpy or torch.
        eps: added to the std so that a zero-variance group divides by ``eps``, not 0.
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).

    Returns:
        (G, n) advantages, float, of the input's kind (numpy in, numpy out; torch in, torch out).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must be 2-D (num_groups, group_size)")
    if eps < 0:
        raise ValueError(f"eps ({eps}) must be >= 0")
    if isinstance(rewards, torch.Tensor):
        r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
        centred = r - r.mean(dim=1, keepdim=True)  # (G, n)
        if not scale_by_std:
            return centred
        return centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)  # (G, n)
    r = np.asarray(rewards)
    r = r.astype(np.float64 if r.dtype == np.float64 else np.float32)  # keep float64, else float32
    centred = r - r.mean(axis=1, keepdims=True)  # (G, n)
    if not scale_by_std:
        return centred
    return centred / (r.std(axis=1, ddof=0, keepdims=True) + eps)  # (G, n)
