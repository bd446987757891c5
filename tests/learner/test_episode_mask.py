"""A multi-turn episode's observation and tool tokens are context, never trained on: the learner's
input is the prompt then every token of the episode, in order, and its ``loss_mask`` keeps the
policy's tokens alone in the loss, in every policy loss and aggregation mode, with the entropy
bonus and the KL term too: the loss's gradient at an observation token is exactly zero."""

import typing
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.learner.batch import collate, stale_samples
from asyncrl.learner.config import AlgorithmConfig, LossAggMode, PolicyLoss
from asyncrl.learner.step import micro_loss
from asyncrl.wire.schema import Episode, Group, Sample

PROMPT = np.array([3, 4, 5], dtype=np.int32)
# turn 1 (3 tokens), an observation (2), turn 2 (2 tokens), a tool result (3), turn 3 (1)
MASK = np.array([1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=np.uint8)


def episode(uid: str, shift: int, versions=None) -> Sample:
    ids = np.arange(10, 10 + len(MASK), dtype=np.int32) + shift
    logprobs = np.where(MASK == 1, -0.7 - 0.1 * np.arange(len(MASK)), 0.0).astype(np.float32)
    return Sample(uid, ids, logprobs, "", "stop", version_segments=versions, episode=Episode(uid, MASK, turns=3))


def group(version: int = 0, segments=None) -> Group:
    return Group(
        "e", "guess/0", "guess", "", "", PROMPT, version, "gen", [episode("e/0", 0, segments), episode("e/1", 7)]
    )


def observation_positions() -> np.ndarray:
    """Positions t of the (B, L-1) layout that predict an observation token (token t + 1)."""
    return len(PROMPT) - 1 + np.flatnonzero(MASK == 0)


def test_the_learner_reads_prompt_then_every_episode_token_and_trains_the_policy_tokens_only():
    batch = collate([group()], [[1.0, -1.0]], pad_id=0)
    for row, sample in enumerate(group().samples):
        assert batch.input_ids[row].tolist() == PROMPT.tolist() + sample.response_ids.tolist()
        P = len(PROMPT)
        assert batch.response_mask[row, P - 1 :].tolist() == MASK.astype(float).tolist()
        assert batch.behaviour_logprobs[row, observation_positions()].abs().sum() == 0
    assert batch.num_tokens == 2 * int(MASK.sum())


def test_staleness_is_the_oldest_trained_policy_tokens():
    # Version 2 sampled the first turn, and the observation after it came in under version 2 too;
    # version 3 sampled the second turn on. With the first turn past the staleness bound
    # (trained_from 3), the oldest trained token is the policy's of version 3, not the observation's.
    g = group(2, [[0, 2], [5, 3]])
    g.samples[0].trained_from = 3
    batch = collate([g], [[1.0, -1.0]], pad_id=0)
    assert batch.policy_version.tolist() == [3, 2]  # the second sample: its group's stamp


def test_an_episode_whose_policy_tokens_are_all_too_stale_trains_nothing():
    g = group()
    g.samples[0].trained_from = 10  # past every policy token but the last
    assert stale_samples(g) == []
    g.samples[0].trained_from = 11
    assert stale_samples(g) == ["e/0"]


@pytest.mark.parametrize("mode", typing.get_args(LossAggMode))
@pytest.mark.parametrize("policy_loss", typing.get_args(PolicyLoss))
def test_the_gradient_at_every_observation_token_is_exactly_zero(policy_loss, mode):
    batch = collate([group()], [[1.0, -1.0]], pad_id=0)
    mask = batch.response_mask
    algo = AlgorithmConfig(
        policy_loss=policy_loss, loss_agg_mode=mode, entropy_coef=0.1, kl={"coef": 0.1, "estimator": "k3"}
    )
    torch.manual_seed(0)
    logprobs = (batch.behaviour_logprobs + 0.3 * torch.randn(mask.shape)).requires_grad_(True)
    entropy = torch.rand(mask.shape, requires_grad=True)
    step = SimpleNamespace(
        proximal=None,
        ref=batch.behaviour_logprobs - 0.2,
        beta=0.1,
        norm_tokens=int(mask.sum(dim=1).max()),
        version_before=0,
        weight_totals=None,
    )
    scores = SimpleNamespace(logprobs=logprobs, entropy=entropy)
    num_tokens, num_seqs = int(mask.sum()), mask.shape[0]
    loss, *_ = micro_loss(algo, step, SimpleNamespace(lo=0, hi=2), batch, scores, num_tokens, num_seqs)
    loss.backward()
    outside = (mask == 0).numpy()
    assert np.all(logprobs.grad.numpy()[outside] == 0) and np.all(entropy.grad.numpy()[outside] == 0)
    assert logprobs.grad[mask == 1].abs().sum() > 0  # the policy's tokens are trained


def test_per_token_rewards_reach_gae_on_the_tokens_that_earned_them():
    # A reward of 1 for the first turn (on the observation after it, where a reward function
    # placed it: it moves to the turn's last token) and 0.5 for the episode's end, in a sample
    # whose reward is their sum; values 0, gamma = lam = 1: each token's advantage is the reward
    # still to come after it, so the second turn's tokens are not credited with the first's.
    from asyncrl.learner.advantages import gae_advantages
    from asyncrl.learner.critic import token_rewards

    g = group()
    for sample in g.samples:
        sample.token_rewards = np.zeros(len(MASK), np.float32)
        sample.token_rewards[3] = 1.0  # on the observation after turn 1
        sample.reward = 1.5
    batch = collate([g], [[0.0, 0.0]], pad_id=0)
    P = len(PROMPT)
    placed = batch.token_rewards[0, P - 1 :].tolist()
    assert placed[2] == 1.0 and sum(placed) == 1.0  # moved onto turn 1's last token
    r = token_rewards(batch, torch.tensor([1.5, 1.5]))
    assert torch.allclose(r.sum(dim=1), torch.tensor([1.5, 1.5]))
    adv, _ = gae_advantages(r, torch.zeros_like(r), batch.response_mask, gamma=1.0, lam=1.0)
    row = adv[0, P - 1 :].tolist()
    trained = [t for t in range(len(MASK)) if MASK[t]]
    assert [row[t] for t in trained] == [1.5, 1.5, 1.5, 0.5, 0.5, 0.5]
    assert all(row[t] == 0 for t in range(len(MASK)) if not MASK[t])
