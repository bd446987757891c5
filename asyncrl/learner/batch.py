"""Groups -> padded token tensors for one training step, and per-token log-probabilities.

Alignment: a causal LM's logits at position t predict the token at t + 1, so every per-token
tensor the loss reads is (B, L - 1) and indexed by the *predicting* position: entry t is about
``input_ids[:, t + 1]``. For a sequence ``prompt (P tokens) + response (T tokens)`` the response
tokens sit at positions P..P+T-1 of ``input_ids`` and are predicted from positions P-1..P+T-2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from asyncrl.wire.schema import Group, sample_prompt_ids, token_versions
from asyncrl.wire.schema import loss_mask as policy_mask


@dataclass
class TrainBatch:
    """One step's sequences: B = total samples of the groups, L = longest prompt + response."""

    input_ids: torch.Tensor
    """(B, L) int64 prompt then response tokens, right-padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """(B, L) int64, 1 on prompt and response tokens, 0 on padding."""
    response_mask: torch.Tensor
    """(B, L-1) float32, 1 at position t when ``input_ids[:, t+1]`` is a response token that is
    trained on: the policy sampled it (an episode's ``loss_mask``: observation and tool tokens
    are context only) and it is from the sample's ``trained_from`` on (earlier ones were too
    stale). Every loss, aggregation and statistic reads the tokens through this mask."""
    behaviour_logprobs: torch.Tensor
    """(B, L-1) float32 generator log-probabilities of ``input_ids[:, t+1]``; 0 off the response."""
    advantages: torch.Tensor
    """(B, L-1) float32, each sample's advantage on every position of its row (use with the mask)."""
    behaviour_version: torch.Tensor
    """(B, L-1) int64 policy version that sampled ``input_ids[:, t+1]`` (a sample's
    ``version_segments``: a weight update swapped in while it was sampled); off the response,
    the row's ``policy_version``."""
    policy_version: torch.Tensor
    """(B,) int64 version of each sequence's oldest trained policy token: its staleness is
    measured from it (the group's ``policy_version`` unless the sample's segments start later or
    its oldest ones are masked; a row with none trained: its oldest policy token's)."""
    group_index: torch.Tensor
    """(B,) int64 index of each sequence's group in the list given to ``collate``."""
    token_rewards: torch.Tensor
    """(B, L-1) float32 the samples' per-token rewards (``Sample.token_rewards``) at the positions
    that predict their tokens, each moved onto a trained token (``place_token_rewards``); 0
    elsewhere and for samples without them. Their row sums are part of each sample's reward."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Response tokens in the batch (the loss's denominator)."""
        return int(self.response_mask.sum().item())

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop``, with the columns that are padding in every one of them cut off."""
        rows = {f.name: getattr(self, f.name)[start:stop] for f in fields(self)}
        length = max(int(rows["attention_mask"].sum(dim=1).max().item()), 2) if stop > start else 2
        for name in ("input_ids", "attention_mask"):
            rows[name] = rows[name][:, :length]
        for name in ("response_mask", "behaviour_logprobs", "behaviour_version", "advantages", "token_rewards"):
            rows[name] = rows[name][:, : length - 1]
        return TrainBatch(**rows)

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(
    groups: list[Group],
    advantages: np.ndarray | torch.Tensor | Sequence[Sequence[float]],
    pad_id: int,
) -> TrainBatch:
    """Pack every sample of every group into one right-padded batch, in order (group, sample).

    Args:
        groups: the groups of the step; each needs a non-empty prompt (the first response token
            must be predicted from somewhere).
        advantages: ``advantages[g][i]`` is the advantage of sample i of group g: a (G, n) array,
            or a list of per-group rows when groups differ in size.
        pad_id: token id that fills the padding (never attended to nor trained on).
    """
    if not groups:
        raise ValueError("groups is empty: a batch needs at least one group")
    if len(advantages) != len(groups):
        raise ValueError(f"advantages has {len(advantages)} rows, must have one per group ({len(groups)})")
    rows: list[tuple] = []
    for g_index, group in enumerate(groups):
        if len(group.prompt_ids) == 0:
            raise ValueError(f"group {group.group_id}: prompt_ids is empty, must hold at least one token")
        if len(advantages[g_index]) != len(group.samples):
            raise ValueError(
                f"group {group.group_id}: advantages row has {len(advantages[g_index])} entries, "
                f"must have one per sample ({len(group.samples)})"
            )
        for i, sample in enumerate(group.samples):
            adv = float(advantages[g_index][i])
            versions = token_versions(sample, group.policy_version)  # (T,)
            rows.append(
                (
                    sample_prompt_ids(group, sample),  # a later part of a split episode follows its own context
                    sample.response_ids,
                    sample.logprobs,
                    adv,
                    versions,
                    sample.trained_from,
                    g_index,
                    policy_mask(sample),
                    sample.token_rewards,
                )
            )

    B = len(rows)
    L = max(max(len(p) + len(r) for p, r, *_ in rows), 2)  # >= 2 so that L - 1 >= 1
    # Filled as numpy arrays: the rows may be read-only views of wire frames, which numpy copies
    # from as from any array (torch.from_numpy of a read-only array warns and may not be written).
    input_ids = np.full((B, L), pad_id, dtype=np.int64)
    attention_mask = np.zeros((B, L), dtype=np.int64)
    response_mask = np.zeros((B, L - 1), dtype=np.float32)
    behaviour_logprobs = np.zeros((B, L - 1), dtype=np.float32)
    advantage_rows = np.zeros((B, L - 1), dtype=np.float32)
    behaviour_version = np.zeros((B, L - 1), dtype=np.int64)
    policy_version = np.zeros(B, dtype=np.int64)
    group_index = np.zeros(B, dtype=np.int64)
    token_reward_rows = np.zeros((B, L - 1), dtype=np.float32)
    for b, (prompt, response, logprobs, adv, versions, trained_from, g_index, loss_mask, rewards) in enumerate(rows):
        P, T = len(prompt), len(response)
        input_ids[b, :P] = prompt
        input_ids[b, P : P + T] = response
        attention_mask[b, : P + T] = 1
        # Response token j sits at position P + j and is predicted from position P + j - 1;
        # tokens before trained_from stay as context, out of the loss.
        response_mask[b, P - 1 + trained_from : P - 1 + T] = 1.0
        if loss_mask is not None:  # a multi-turn episode: observation and tool tokens are context only
            response_mask[b, P - 1 : P - 1 + T] *= loss_mask
        behaviour_logprobs[b, P - 1 : P - 1 + T] = logprobs
        if rewards is not None:
            token_reward_rows[b, P - 1 : P - 1 + T] = place_token_rewards(rewards, response_mask[b, P - 1 : P - 1 + T])
        advantage_rows[b, :] = adv
        # Staleness is the oldest policy token's: an observation token was sampled by no policy.
        own = versions if loss_mask is None or not loss_mask.any() else versions[loss_mask != 0]
        own_from = (
            versions[trained_from:] if loss_mask is None else versions[trained_from:][loss_mask[trained_from:] != 0]
        )
        trained = own_from if len(own_from) else own
        oldest = int(trained.min()) if T else groups[g_index].policy_version
        behaviour_version[b, :] = oldest
        behaviour_version[b, P - 1 : P - 1 + T] = versions
        policy_version[b] = oldest
        group_index[b] = g_index
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        response_mask=torch.from_numpy(response_mask),
        behaviour_logprobs=torch.from_numpy(behaviour_logprobs),
        advantages=torch.from_numpy(advantage_rows),
        behaviour_version=torch.from_numpy(behaviour_version),
        policy_version=torch.from_numpy(policy_version),
        group_index=torch.from_numpy(group_index),
        token_rewards=torch.from_numpy(token_reward_rows),
    )


def place_token_rewards(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Per-token rewards moved onto trained tokens: a reward on a token that is not trained (an
    environment's answer, a tool's result, a token past the staleness bound) goes to the last
    trained token before it, the action that led to it, else to the first one after it. Nothing
    is lost unless no token is trained. ``trained``: the (T,) response mask of the row.

    >>> place_token_rewards(np.array([0.0, 0.0, 0.5, 0.0, 1.0]), np.array([1, 1, 0, 0, 1])).tolist()
    [0.0, 0.5, 0.0, 0.0, 1.0]
    """
    out = np.where(trained > 0, rewards, 0.0).astype(np.float32)
    kept = np.flatnonzero(trained > 0)
    if not len(kept):
        return out
    for t in np.flatnonzero((trained == 0) & (rewards != 0)):
        before = kept[kept < t]
        out[before[-1] if len(before) else kept[0]] += rewards[t]
    return out


def stale_samples(group: Group) -> list[str]:
    """Uids of ``group``'s samples with no token trained: every one was past the staleness bound
    (``Sample.trained_from`` at the end of a non-empty answer). They count as dropped, ``stale``."""
    return [s.uid for s in group.samples if trains_nothing(s)]


def fully_masked(groups: list[Group]) -> torch.Tensor:
    """(B,) bool in ``collate``'s order: the rows of ``stale_samples``."""
    return torch.tensor([trains_nothing(s) for g in groups for s in g.samples])


def trains_nothing(sample) -> bool:
    """True when ``sample`` has policy tokens but none from its ``trained_from`` on (every one
    was past the staleness bound); an empty answer is not one of them."""
    mask = policy_mask(sample)
    if mask is None:
        return 0 < len(sample.response_ids) <= sample.trained_from
    return bool(mask.any()) and not mask[sample.trained_from :].any()


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token: (B, L, V) logits, (B, L) ids -> (B, L-1), float32.

    ``out[b, t] = log_softmax(logits[b, t] / temperature)[input_ids[b, t + 1]]``.

    The generator sampled from softmax(logits / temperature) and reported those log-probabilities
    as the behaviour policy; dividing by the same temperature here makes the learner's policy the
    same distribution, so that pi_theta / mu is 1 when the weights are the same. Computed in
    float32 (log_softmax in bf16 loses ~2 digits, which the importance ratios amplify).
    """
    if temperature <= 0:
        raise ValueError(f"temperature ({temperature}) must be > 0: the learner scores the sampling distribution")
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} must be (B, L, V) with (B, L) = input_ids shape {tuple(input_ids.shape)}"
        )
    logits = logits[:, :-1].float()  # (B, L-1, V)
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].long().unsqueeze(-1)  # (B, L-1, 1)
    # log_softmax(x)[y] = x[y] - logsumexp(x): gather first, never materialise a 2nd (B, L-1, V).
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (B, L-1)
