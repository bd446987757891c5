"""PolicyTrainer on a tiny model: what one step trains on and how many updates it makes.

All engines share one gloo process group in this process (DeepSpeed allows re-initialising
engines on it). Truncated answers are kept, masked out of the loss or penalised
(``algorithm.truncation``); several epochs and mini-batches per step (``learner.ppo_epochs``,
``learner.mini_batches``) must land on the same weights as plain-torch AdamW steps; staleness is
counted per version segment and stale tokens are masked out of the loss; the trainer's config
rejects bad values.
"""

import copy

import numpy as np
import pytest
import torch

from asyncrl.learner.advantages import grpo_advantages
from asyncrl.learner.batch import collate, token_logprobs
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.losses import decoupled_ppo_loss
from asyncrl.learner.trainer import PolicyTrainer, TrainerConfig
from asyncrl.learner.truncation import overlong_penalty
from asyncrl.wire.schema import Group
from tests.learner.trainer.steps import GRAD_CLIP, LR, config, make_groups, with_truncated

pytestmark = pytest.mark.slow  # DeepSpeed engines at every ZeRO stage


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"zero_stage \(4\) must be 0, 1, 2 or 3"):
        TrainerConfig(zero_stage=4)
    with pytest.raises(ValueError, match=r"micro_batch_size \(0\) must be >= 1"):
        TrainerConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match=r"micro_batch_tokens \(1\) must be >= 2 or None"):
        TrainerConfig(micro_batch_tokens=1)
    with pytest.raises(ValueError, match=r"top_p \(1.5\) must be in \(0, 1\]"):
        TrainerConfig(top_p=1.5)
    with pytest.raises(ValueError, match=r"logits_chunk_tokens \(0\) must be >= 1"):
        TrainerConfig(logits_chunk_tokens=0)
    with pytest.raises(ValueError, match="extra"):
        TrainerConfig(loss="ppo")  # the loss is algorithm.policy_loss now
    with pytest.raises(ValueError, match="extra"):
        TrainerConfig(learning_rate=1e-3)


def test_truncation_keep_trains_on_truncated_answers_as_they_are(model_dir, groups):
    cut = with_truncated(groups)
    kept = PolicyTrainer(model_dir, config(0)).train_step(cut)
    plain = PolicyTrainer(model_dir, config(0)).train_step(groups)
    assert kept.truncated_frac == 4 / 16 and plain.truncated_frac == 0.0
    assert kept.loss == plain.loss and kept.grad_norm == plain.grad_norm


@pytest.mark.parametrize("stage", [0, 2])
def test_truncation_mask_takes_truncated_answers_out_of_the_loss_but_not_the_baseline(stage, model_dir, groups):
    """mask: one step equals plain torch on the loss mask without the truncated rows, with the
    advantages computed over every sample of each group. The last micro batch (row 15 alone) has
    no token left in the loss and is still a backward pass, the accumulation boundary."""
    from transformers import AutoModelForCausalLM

    cut = with_truncated(groups, cut=((0, 1), (1, 0), (1, 3), (3, 2), (3, 3)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    truncated = torch.tensor([s.finish_reason == "length" for g in cut for s in g.samples])
    mask = batch.response_mask * (~truncated).float()[:, None]
    lp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
    loss, _ = decoupled_ppo_loss(lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, mask)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()

    trainer = PolicyTrainer(model_dir, config(stage), AlgorithmConfig(truncation={"mode": "mask"}))
    stats = trainer.train_step(cut)
    assert stats.truncated_frac == 5 / 16 and stats.sequences == 11
    assert stats.tokens == int(mask.sum())
    assert stats.loss == pytest.approx(loss.item(), rel=1e-5)
    after = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0)


def test_truncation_penalise_adds_dapos_overlong_penalty_to_the_reward(model_dir, groups):
    """penalise (L_max 7, L_cache 3: answers of 5, 6, 7 tokens lose 1/3, 2/3, 1): one step equals
    a step on the same groups whose rewards already hold the penalty."""
    algo = AlgorithmConfig(truncation={"mode": "penalise", "max_tokens": 7, "cache_tokens": 3})
    shifted = copy.deepcopy(groups)
    penalties = []
    for g in shifted:
        p = overlong_penalty([len(s.response_ids) for s in g.samples], 7, 3)
        penalties.extend(p)
        for s, pen in zip(g.samples, p):
            s.reward = float(np.float32(s.reward) + pen)
    assert min(penalties) == pytest.approx(-1.0) and max(penalties) == 0.0  # the test batch spans the interval

    penalised = PolicyTrainer(model_dir, config(0), algo)
    reference = PolicyTrainer(model_dir, config(0))
    for row, expected in zip(penalised.advantages(groups), reference.advantages(shifted)):
        np.testing.assert_allclose(row, expected, rtol=1e-6)
    stats = penalised.train_step(groups)
    assert stats.overlong_penalty == pytest.approx(float(np.mean(penalties)), rel=1e-6)
    assert stats.reward == pytest.approx(np.mean([s.reward for g in groups for s in g.samples]))
    reference.train_step(shifted)
    a, b = penalised.full_state_dict(), reference.full_state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match=r"truncation.mode \(penalise\) needs algorithm.truncation.max_tokens"):
        PolicyTrainer(model_dir, config(0), AlgorithmConfig(truncation={"mode": "penalise"}))


@pytest.mark.parametrize("micro_batch_tokens", [None, 24])
def test_epochs_and_mini_batches_clip_against_the_policy_before_the_first_update(micro_batch_tokens, model_dir, groups):
    """2 epochs x 2 mini-batches of 2 whole groups at ZeRO-2, micro batches of 5 rows (or packed
    to 24 token slots): four updates, each the token-mean loss of its mini-batch with the ratio
    and clip taken against pi_prox from before the first update, land on plain torch's weights;
    one version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    rewards = np.array([[s.reward for s in g.samples] for g in groups])
    batch = collate(groups, grpo_advantages(rewards), pad_id=0)
    with torch.no_grad():
        proximal = token_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
    norms = []
    for _ in range(2):
        for rows in (slice(0, 8), slice(8, 16)):  # groups 0-1, groups 2-3
            ids, att = batch.input_ids[rows], batch.attention_mask[rows]
            lp = token_logprobs(model(input_ids=ids, attention_mask=att).logits, ids)
            loss, _ = decoupled_ppo_loss(
                lp, proximal[rows], batch.behaviour_logprobs[rows], batch.advantages[rows], batch.response_mask[rows]
            )
            optimizer.zero_grad()
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
            optimizer.step()

    trainer = PolicyTrainer(model_dir, config(2, micro_batch_tokens=micro_batch_tokens), ppo_epochs=2, mini_batches=2)
    stats = trainer.train_step(groups)
    assert trainer.version == 1 and stats.version == 1 and trainer.updates == stats.updates == 4
    assert stats.staleness == [0] * 16
    assert stats.grad_norm_by_update == pytest.approx(norms, rel=1e-4)
    assert stats.grad_norm == pytest.approx(np.mean(norms), rel=1e-4)
    assert len(stats.loss_by_update) == 4
    # the policy moves away from pi_prox over the updates; pi_prox / mu is the same throughout
    assert len(stats.approx_kl_by_epoch) == 2 and 0 < stats.approx_kl_by_epoch[0] < stats.approx_kl_by_epoch[1]
    assert len(stats.clipfrac_by_epoch) == 2 and stats.clipfrac >= 0
    assert stats.clipfrac == pytest.approx(stats.clipfrac_high + stats.clipfrac_low)
    assert stats.clipfrac_dual == 0.0 and stats.ppo_kl != 0.0  # no dual clip set; the policy moved
    assert 0.5 < stats.is_weight_mean < 2.0
    after = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-4, rtol=0)


def test_one_epoch_one_mini_batch_is_exactly_the_first_of_several_updates(model_dir, groups):
    """The single-update form (pi_prox = the update's own logprobs, detached) and the first
    update of a two-epoch step (pi_prox from the no-grad forward before it) give the identical
    loss, gradient norm and weights. The second epoch runs at learning rate 0 (a linear decay
    over one update), so its weights are the first update's."""
    single = PolicyTrainer(model_dir, config(0))
    one = single.train_step(groups)
    assert one.loss_by_update is None and one.clipfrac_by_epoch is None and one.approx_kl == 0.0
    assert one.ppo_kl == one.clipfrac_high == one.clipfrac_low == one.clipfrac_dual == 0.0
    decayed = config(0, lr_schedule="linear", lr_decay_steps=1)
    several = PolicyTrainer(model_dir, decayed, ppo_epochs=2)
    two = several.train_step(groups)
    assert two.lr == 0.0 and several.updates == 2
    assert two.loss_by_update[0] == one.loss
    assert two.grad_norm_by_update[0] == one.grad_norm
    a, b = single.full_state_dict(), several.full_state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_mini_batches_never_split_a_group_and_the_learner_config_checks_them():
    from asyncrl.learner.config import LearnerConfig

    with pytest.raises(ValueError, match=r"mini_batches \(5\) must be <= learner.batch_groups \(4\)"):
        LearnerConfig(batch_groups=4, mini_batches=5)
    with pytest.raises(ValueError, match="ppo_epochs"):
        LearnerConfig(ppo_epochs=0)
    assert LearnerConfig(batch_groups=4, ppo_epochs=3, mini_batches=2).updates_per_step == 6
    # ragged groups (3, 4, 2, 5 samples) in 3 mini-batches: runs of whole groups
    trainer = PolicyTrainer.__new__(PolicyTrainer)
    trainer.mini_batches = 3
    sized = [Group(f"g{i}", "p", "t", "", "", np.array([1]), 0, "gen", [None] * n) for i, n in enumerate((3, 4, 2, 5))]
    assert trainer._mini_batches(sized) == [(0, 7), (7, 9), (9, 14)]
    trainer.mini_batches = 8  # more than there are groups: one group each
    assert trainer._mini_batches(sized) == [(0, 3), (3, 7), (7, 9), (9, 14)]


def test_staleness_figures_count_each_segment_at_its_own_version(model_dir, hf_state):
    """Samples spanning an update (versions 0, then 3 from their third token) trained at version 3:
    the sequence is 3 stale (its oldest token), its tokens 3 and 0, and the sampler/learner
    mismatch is measured over the tokens sampled by version 3 alone."""
    model = hf_state[0]
    spanning = make_groups(model.config.vocab_size, policy_version=0, seed=5)
    for g in spanning:
        for s in g.samples:
            s.version_segments = [[0, 0], [2, 3]]
    trainer = PolicyTrainer(model_dir, config(0))
    trainer.version = 3
    stats = trainer.train_step(spanning)
    samples = [s for g in spanning for s in g.samples]
    tokens = sum(len(s.response_ids) for s in samples)
    assert stats.staleness == [3] * len(samples)
    assert stats.token_staleness == {0: tokens - 2 * len(samples), 3: 2 * len(samples)}
    batch = collate(spanning, [np.zeros(len(g.samples)) for g in spanning], pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    raw = (token_logprobs(logits, batch.input_ids) - batch.behaviour_logprobs).exp()  # pi_prox / mu
    fresh = batch.response_mask * (batch.behaviour_version == 3)
    k3 = (raw - 1) - raw.log()
    assert stats.mismatch_kl == pytest.approx(float((k3 * fresh).sum() / fresh.sum()), rel=1e-4)


def test_masking_removes_exactly_the_stale_tokens_from_the_loss(model_dir, hf_state):
    """Tokens before ``trained_from`` change nothing when their behaviour logprobs do (they are out
    of the loss); a token after it does. A sample with none trained is no sequence of the loss."""
    vocab = hf_state[0].config.vocab_size

    def step(garbage_at=None):
        groups = make_groups(vocab, seed=7)
        for g in groups:
            for s in g.samples:
                s.trained_from = 2
                if garbage_at is not None:
                    s.logprobs[garbage_at] -= 3.0  # a behaviour logprob far off pi_prox: a large weight
        groups[0].samples[0].trained_from = len(groups[0].samples[0].response_ids)
        trainer = PolicyTrainer(model_dir, config(0), AlgorithmConfig(correction="decoupled"))
        return trainer.train_step(groups), trainer.full_state_dict(), groups

    stats, weights, groups = step()
    samples = [s for g in groups for s in g.samples]
    masked = sum(s.trained_from for s in samples)
    assert stats.tokens == sum(len(s.response_ids) for s in samples) - masked
    assert stats.stale_tokens_masked == masked and stats.stale_samples_masked == 1
    assert stats.sequences == len(samples) - 1 and len(stats.staleness) == len(samples) - 1
    _, same, _ = step(garbage_at=1)  # inside every masked prefix
    for key in weights:
        torch.testing.assert_close(same[key], weights[key], rtol=0, atol=0)
    _, other, _ = step(garbage_at=2)  # the first trained token
    assert any(not torch.equal(other[key], weights[key]) for key in weights)
