"""Micro batches hold whole examples, and packing changes the layout, not the loss."""

import pytest
import torch

from asyncrl.learner.offline.config import ObjectiveConfig
from asyncrl.learner.offline.data import Example
from asyncrl.learner.offline.micro import cut_micro_batches, score_micro
from asyncrl.learner.offline.objective import DPOObjective, SFTObjective
from asyncrl.models.sft import TokenExample
from tests.factories import small_qwen2


def example(uid: str, prompt: list[int], *answers: list[int]) -> Example:
    seqs = tuple(TokenExample(prompt + a, [0] * len(prompt) + [1] * len(a)) for a in answers)
    return Example(uid, seqs, prompt, "")


def examples(pairs: bool = False) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(7):
        prompt = torch.randint(3, 50, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        answers = [torch.randint(3, 50, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()]
        if pairs:
            answers.append(torch.randint(3, 50, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist())
        out.append(example(f"e{i}", prompt, *answers))
    return out


def batch_loss(model, objective, batch, micro_batch_size, micro_batch_tokens):
    total, figures = 0.0, {}
    norm = objective.normaliser(batch)
    for micro in cut_micro_batches(batch, micro_batch_size, micro_batch_tokens):
        loss, figs = objective.loss(micro, score_micro(model, micro, 0, micro_batch_tokens is not None), norm)
        total = total + loss
        for k, v in figs.items():
            figures[k] = figures.get(k, 0.0) + v
    return total, figures


def test_micro_batches_keep_pairs_whole_and_stay_in_budget():
    batch = examples(pairs=True)
    for micros in (
        cut_micro_batches(batch, 3, None),
        cut_micro_batches(batch, 1, None),
        cut_micro_batches(batch, 64, 40),
    ):
        assert [e for m in micros for e in m] == batch  # every example once, in order
    assert all(sum(len(e.sequences) for e in m) <= 4 for m in cut_micro_batches(batch, 4, None))
    assert all(sum(e.tokens for e in m) <= 40 or len(m) == 1 for m in cut_micro_batches(batch, 64, 40))


@pytest.mark.parametrize("pairs", [False, True])
def test_packed_loss_and_gradient_equal_the_padded_ones(pairs):
    model = small_qwen2(64, attn="sdpa").float()
    batch = examples(pairs)
    objective = SFTObjective()
    if pairs:
        objective = DPOObjective(ObjectiveConfig(kind="dpo", beta=0.5), {e.uid: (-20.0, -21.0) for e in batch})
    results = []
    for size, tokens in ((64, None), (2, None), (64, 30), (64, 1000)):
        model.zero_grad()
        loss, figures = batch_loss(model, objective, batch, size, tokens)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((float(loss.detach()), figures, grad))
    base_loss, base_figures, base_grad = results[0]
    for loss, figures, grad in results[1:]:
        assert loss == pytest.approx(base_loss, rel=1e-5)
        assert figures == pytest.approx(base_figures, rel=1e-4, abs=1e-6)
        assert torch.allclose(grad, base_grad, rtol=1e-4, atol=1e-6)


def test_sft_loss_is_the_token_mean_nll_of_the_answers():
    model = small_qwen2(64).float()
    batch = examples()
    loss, _ = batch_loss(model, SFTObjective(), batch, 64, None)
    want, count = 0.0, 0
    with torch.no_grad():
        for e in batch:
            seq = e.sequences[0]
            logits = model(torch.tensor([seq.ids])).logits[0]  # (L, V)
            logp = torch.log_softmax(logits[:-1], -1)
            for t in range(len(seq.ids) - 1):
                if seq.mask[t + 1]:
                    want -= float(logp[t, seq.ids[t + 1]])
                    count += 1
    assert float(loss) == pytest.approx(want / count, rel=1e-5)


def test_a_dpo_step_on_pairs_moves_the_implicit_margin_up():
    model = small_qwen2(64).float()
    batch = examples(pairs=True)
    with torch.no_grad():
        scored = score_micro(model, batch, 0, False)
    reference = {e.uid: (float(s[0].sum()), float(s[1].sum())) for e, s in zip(batch, scored)}
    objective = DPOObjective(ObjectiveConfig(kind="dpo", beta=0.1), reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    _, start = batch_loss(model, objective, batch, 64, None)
    assert start["reward_margin"] == pytest.approx(0.0, abs=1e-5)  # the policy is the reference
    for _ in range(3):
        optimizer.zero_grad()
        loss, _ = batch_loss(model, objective, batch, 64, None)
        loss.backward()
        optimizer.step()
    _, end = batch_loss(model, objective, batch, 64, None)
    assert end["reward_margin"] > 0.05
    assert end["reward_accuracy"] > 0.5
    assert end["dpo_loss"] < start["dpo_loss"]
