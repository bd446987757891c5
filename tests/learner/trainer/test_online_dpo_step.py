"""PolicyTrainer's online DPO step on a tiny model (``asyncrl.learner.online_dpo``).

Micro batches of 3 answers cut pairs apart, so the two-pass gradient is exercised: the weights
after the trainer's updates must be those of plain-torch AdamW on ``preference_loss`` of the
pairs' summed (or averaged) token log-probabilities, computed whole; the loss the step reports
is that of hand-computed sequence log-probabilities; and a step raises the chosen answers'
implicit rewards over the rejected ones'.
"""

import numpy as np
import pytest
import torch

from asyncrl.learner.batch import collate, token_logprobs
from asyncrl.learner.config import AlgorithmConfig, TrainerConfig
from asyncrl.learner.online_dpo import select_pairs
from asyncrl.learner.preference_losses import preference_loss
from asyncrl.learner.trainer import PolicyTrainer
from tests.learner.trainer.steps import GRAD_CLIP, LR

pytestmark = pytest.mark.slow  # DeepSpeed engines


def trainer_config():
    return TrainerConfig(zero_stage=0, lr=LR, grad_clip=GRAD_CLIP, micro_batch_size=3)


def pair_rows(groups, pairs_mode):
    """(chosen rows, rejected rows) of ``collate(groups)``'s rows, group by group."""
    chosen, rejected, offset = [], [], 0
    for g in groups:
        for c, r in select_pairs(np.array([s.reward for s in g.samples]), pairs_mode):
            chosen.append(offset + c)
            rejected.append(offset + r)
        offset += len(g.samples)
    return torch.tensor(chosen), torch.tensor(rejected)


def sequence_logprobs(model, batch, normalise):
    lp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
    total = (lp * batch.response_mask).sum(dim=1)
    return total / batch.response_mask.sum(dim=1) if normalise else total


def dpo_loss(model, ref_seq, batch, rows, algo, weights=None):
    dpo = algo.dpo
    seq = sequence_logprobs(model, batch, dpo.normalise)
    chosen, rejected = rows
    out = preference_loss(
        seq[chosen], seq[rejected], ref_seq[chosen], ref_seq[rejected], dpo.beta, dpo.loss_type, dpo.label_smoothing
    )
    losses = out.losses
    if dpo.nll_coef > 0:  # RPO: the chosen answers' token-mean NLL
        lp = token_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
        token_mean = (lp * batch.response_mask).sum(dim=1) / batch.response_mask.sum(dim=1)
        losses = losses - dpo.nll_coef * token_mean[chosen]
    w = torch.ones(len(chosen)) if weights is None else weights
    return (losses * w).sum() / len(chosen), out


def plain_torch_dpo(model_dir, groups, algo, mini_groups, steps=1):
    """``steps`` AdamW updates, each on the pairs of the groups ``mini_groups[k]`` (whole batch
    computed at once): the weights after them, and each update's loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    losses = []
    for _ in range(steps):
        for members in mini_groups:
            part = [groups[i] for i in members]
            batch = collate(part, [np.zeros(len(g.samples)) for g in part], pad_id=0)
            with torch.no_grad():
                ref_seq = sequence_logprobs(ref, batch, algo.dpo.normalise)
            loss, _ = dpo_loss(model, ref_seq, batch, pair_rows(part, algo.dpo.pairs), algo)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize(
    "dpo, mini_batches",
    [
        ({"beta": 0.5}, 1),
        ({"beta": 0.5, "loss_type": "ipo", "pairs": "all"}, 2),
        ({"beta": 0.5, "loss_type": "hinge", "label_smoothing": 0.0}, 1),
        ({"beta": 0.5, "nll_coef": 0.5, "pairs": "all"}, 2),
    ],
)
def test_updates_equal_plain_torch_preference_loss(model_dir, groups, dpo, mini_batches):
    algo = AlgorithmConfig(objective="online_dpo", dpo=dpo)
    trainer = PolicyTrainer(model_dir, trainer_config(), algo, mini_batches=mini_batches)
    stats = trainer.train_step(groups)
    minis = [list(p) for p in np.array_split(np.arange(len(groups)), mini_batches)]
    expected, losses = plain_torch_dpo(model_dir, groups, algo, minis)
    after = trainer.full_state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0)
    assert stats.loss == pytest.approx(float(np.mean(losses)), rel=1e-5)
    assert stats.dpo_pairs == sum(len(pair_rows([g], algo.dpo.pairs)[0]) for g in groups)
    assert stats.dpo_groups_unpaired == 0
    assert stats.updates == mini_batches and stats.grad_norm > 0


def test_reported_loss_is_preference_loss_and_a_step_raises_the_chosen(model_dir, groups):
    """Step 2's loss is preference_loss of hand-computed sequence logprobs under the weights after
    step 1 against the starting ones; step 1 moved the chosen answers' implicit rewards above
    the rejected ones' (they start equal: policy == reference)."""
    from transformers import AutoModelForCausalLM

    algo = AlgorithmConfig(objective="online_dpo", dpo={"beta": 0.5})
    trainer = PolicyTrainer(model_dir, trainer_config(), algo)
    first = trainer.train_step(groups)
    assert first.loss == pytest.approx(np.log(2), rel=1e-6)  # h = 0 for every pair
    assert first.dpo_margin == pytest.approx(0.0, abs=1e-6)

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.load_state_dict(trainer.full_state_dict())
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = collate(groups, [np.zeros(len(g.samples)) for g in groups], pad_id=0)
    rows = pair_rows(groups, "best_worst")
    with torch.no_grad():
        loss, out = dpo_loss(policy, sequence_logprobs(ref, batch, False), batch, rows, algo)
    second = trainer.train_step(groups)
    assert second.loss == pytest.approx(float(loss), rel=1e-5)
    assert second.dpo_margin == pytest.approx(out.margin, rel=1e-5)
    assert second.dpo_margin > 0 and second.dpo_accuracy == 1.0
    assert second.dpo_chosen_reward > 0 > second.dpo_rejected_reward
    assert second.loss < first.loss


def test_priority_weights_scale_each_pair_and_tied_groups_train_nothing(model_dir, groups):
    from copy import deepcopy

    tied = deepcopy(groups)
    for s in tied[1].samples:
        s.reward = 1.0
    weights = [1.0, 3.0, 0.5, 2.0]
    algo = AlgorithmConfig(objective="online_dpo", dpo={"beta": 0.5})
    trainer = PolicyTrainer(model_dir, trainer_config(), algo)
    stats = trainer.train_step(tied, weights=weights)
    assert stats.dpo_groups_unpaired == 1 and stats.dpo_pairs == 3

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    paired = [tied[0], tied[2], tied[3]]
    batch = collate(paired, [np.zeros(len(g.samples)) for g in paired], pad_id=0)
    with torch.no_grad():
        ref_seq = sequence_logprobs(model, batch, False)
    loss, _ = dpo_loss(model, ref_seq, batch, pair_rows(paired, "best_worst"), algo, torch.tensor([1.0, 0.5, 2.0]))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    after = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0)


def test_a_batch_without_a_pair_takes_no_update(model_dir, groups):
    from copy import deepcopy

    tied = deepcopy(groups)
    for g in tied:
        for s in g.samples:
            s.reward = 0.0
    trainer = PolicyTrainer(model_dir, trainer_config(), AlgorithmConfig(objective="online_dpo"))
    before = trainer.full_state_dict()
    stats = trainer.train_step(tied)
    assert (stats.version, stats.updates, stats.dpo_pairs, stats.dpo_groups_unpaired) == (1, 0, 0, 4)
    assert stats.dpo_accuracy is None and stats.loss == 0.0
    after = trainer.full_state_dict()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, atol=0, rtol=0)
