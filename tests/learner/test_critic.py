"""The critic: clipped value loss by hand, token rewards, GAE/V-trace through its own engine,
and PPO with GAE in the policy trainer."""

import math
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from asyncrl.learner.batch import collate  # noqa: E402
from asyncrl.learner.config import AlgorithmConfig, CriticConfig, TrainerConfig  # noqa: E402
from asyncrl.learner.critic import CriticTrainer, token_rewards  # noqa: E402
from asyncrl.learner.losses import value_loss  # noqa: E402
from asyncrl.learner.trainer import PolicyTrainer  # noqa: E402
from tests.learner.trainer.steps import make_groups  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model

    return build_tiny_model(
        TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), tmp_path_factory.mktemp("tiny")
    )


def test_value_loss_by_hand():
    # V 1.0 (old 0.5), R 2.0, clip 0.2: unclipped (1 - 2)^2 = 1; clipped 0.7 -> (0.7 - 2)^2 = 1.69 -> max 1.69
    # V 0.6 (old 0.5), R 0.0: unclipped 0.36; clipped 0.6 (inside) -> 0.36
    values, old, ret = torch.tensor([[1.0, 0.6]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]])
    loss, clipped = value_loss(values, old, ret, torch.ones(1, 2), value_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 1.69, 0.5 * 0.36]]))
    assert clipped.tolist() == [[True, False]]
    loss, _ = value_loss(values, old, ret, torch.ones(1, 2), value_clip=None)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.18]]))


def test_values_well_inside_the_clip_range_count_as_unclipped():
    # |values - old| <= 0.15 < clip 0.2 everywhere. Old values of many magnitudes make
    # old + clip(values - old) differ from values by an ulp for some tokens (v - old is rounded):
    # those must not count as clipped, nor change the loss.
    generator = torch.Generator().manual_seed(0)
    shape = (256, 256)
    old = (torch.rand(shape, generator=generator) - 0.5) * 0.1 * torch.exp(-20 * torch.rand(shape, generator=generator))
    values = (torch.rand(shape, generator=generator) - 0.5) * 0.2
    returns = torch.full(shape, 3.0)
    loss, clipped = value_loss(values, old, returns, torch.ones(shape), value_clip=0.2)
    assert not clipped.any()
    torch.testing.assert_close(loss, 0.5 * (values - returns).square(), rtol=0, atol=0)


def test_token_rewards_put_the_reward_on_the_last_response_token():
    groups = make_groups(40, num_groups=1, group_size=2)
    batch = collate(groups, [[0.0, 0.0]], pad_id=0)
    r = token_rewards(batch, torch.tensor([1.0, 2.0]))
    for b, value in enumerate((1.0, 2.0)):
        last = int(torch.nonzero(batch.response_mask[b]).max())
        assert r[b, last] == value and r[b].sum() == value


def test_first_critic_step_gives_discounted_outcome_advantages(model_dir):
    # The value head starts at zero, so delta_t = r_t and A_t = lam^(T-1-t) * R.
    lam = 0.9
    critic = CriticTrainer(model_dir, CriticConfig(lam=lam), TrainerConfig(micro_batch_size=4))
    groups = make_groups(40, num_groups=1, group_size=2)
    batch = collate(groups, [[0.0, 0.0]], pad_id=0)
    rewards = torch.tensor([1.0, 0.0])
    (adv,), stats = critic.advantages_and_step([batch], [token_rewards(batch, rewards)], [None], batch.num_tokens)
    mask = batch.response_mask[0] > 0
    T = int(mask.sum())
    torch.testing.assert_close(adv[0][mask], torch.tensor([lam ** (T - 1 - t) for t in range(T)]))
    assert stats["value_mean"] == 0.0 and stats["value_loss"] > 0
    # the step moved the values towards the returns
    (adv2,), stats2 = critic.advantages_and_step([batch], [token_rewards(batch, rewards)], [None], batch.num_tokens)
    assert stats2["value_mean"] != 0.0 and stats2["value_loss"] < stats["value_loss"]


@pytest.mark.parametrize("weight_decay", [None, 0.05])
def test_the_critic_decays_its_weights_as_configured(model_dir, weight_decay):
    # None: the default, no decay (torch's AdamW alone would apply 0.01)
    cfg = CriticConfig() if weight_decay is None else CriticConfig(weight_decay=weight_decay)
    critic = CriticTrainer(model_dir, cfg, TrainerConfig(micro_batch_size=4))
    assert [g["weight_decay"] for g in critic.engine.optimizer.param_groups] == [weight_decay or 0.0]


@pytest.mark.parametrize("targets", ["gae", "vtrace"])
def test_ppo_with_a_critic_trains(model_dir, targets):
    algo = AlgorithmConfig(
        adv_estimator="gae", critic={"lr": 1e-3, "targets": targets}, kl={"coef": 0.1, "use_in": "reward"}
    )
    trainer = PolicyTrainer(model_dir, TrainerConfig(micro_batch_size=5, lr=1e-3), algo)
    groups = make_groups(trainer.hf_config.vocab_size)
    before = trainer.full_state_dict()
    losses = []
    for _ in range(3):
        stats = trainer.train_step(groups)
        assert math.isfinite(stats.loss) and math.isfinite(stats.value_loss)
        losses.append(stats.value_loss)
    if targets == "gae":  # fixed targets: the value loss falls (V-trace's move with pi_prox)
        assert losses[-1] < losses[0]
    after = trainer.full_state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)
    batch = trainer.train_batch(groups)  # priorities: group-centred rewards stand in for gae
    assert np.isfinite(batch.advantages.numpy()).all()


def test_critic_config_rules():
    with pytest.raises(ValueError, match=r"algorithm.critic is set but algorithm.adv_estimator 'grpo' does not use it"):
        AlgorithmConfig(critic=CriticConfig())
    assert AlgorithmConfig(adv_estimator="gae", critic={}).critic.lam == 0.95


def test_token_whitening_takes_the_std_estimator():
    from asyncrl.learner.critic import whiten_tokens

    values = torch.tensor([[1.0, 3.0, 9.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # tokens 1, 3, 5: mean 3, variance 8/3 (population) or 8/2 (unbiased); padding stays 0
    torch.testing.assert_close(
        whiten_tokens(values, mask, eps=0.0), torch.tensor([[-2.0, 0.0, 0.0], [2.0, 0.0, 0.0]]) / math.sqrt(8 / 3)
    )
    torch.testing.assert_close(
        whiten_tokens(values, mask, unbiased=True, eps=0.0), torch.tensor([[-2.0, 0.0, 0.0], [2.0, 0.0, 0.0]]) / 2.0
    )
