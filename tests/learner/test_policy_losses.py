"""Policy losses, corrections and aggregation modes against values worked out by hand, and the
reduction property: with mu equal to the learner's logprobs, every correction is plain PPO."""

import math

import numpy as np
import pytest
import torch

from asyncrl.generators.completion import Completion
from asyncrl.generators.groups import build_groups
from asyncrl.learner.batch import collate
from asyncrl.learner.config import AlgorithmConfig
from asyncrl.learner.losses import (
    CORRECTIONS,
    LOSS_AGG_MODES,
    aggregate,
    compute_policy_loss,
    log_linear_proximal_logprobs,
)
from asyncrl.learner.policy_losses import (
    CLIP_DUAL,
    CLIP_HIGH,
    CLIP_LOW,
    CLIP_NONE,
    POLICY_LOSSES,
    cispo_loss,
    gmpo_loss,
    gspo_loss,
    ppo_clip_loss,
    sapo_loss,
)

ln = math.log


def t(*rows):
    return torch.tensor([list(r) for r in rows], dtype=torch.float32)


# --- policy losses ----------------------------------------------------------------------------


def test_ppo_clip_higher_is_asymmetric():
    # token 0: ratio 1.25, A = +1: symmetric 0.2 clips to 1.2; clip_high 0.28 leaves 1.25
    # token 1: ratio 0.7, A = -1: pg1 = 0.7, pg2 = 0.8 -> 0.8 (clipped at 1 - 0.2)
    old = t([-1.0, -1.0])
    lp = old + t([ln(1.25), ln(0.7)])
    adv = t([1.0, -1.0])
    loss, clipped = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, t([-1.25, 0.8]))
    assert clipped.tolist() == [[CLIP_NONE, CLIP_LOW]]
    sym, clipped = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(sym, t([-1.2, 0.8]))
    assert clipped.tolist() == [[CLIP_HIGH, CLIP_LOW]]


def test_dual_clip_bounds_negative_advantage_only():
    # ratio 5: A = -1 -> max(5, 1.2) = 5, dual clip 3 -> 3;  A = +1 -> max(-5, -1.2) = -1.2 (no dual)
    old = t([-2.0, -2.0])
    lp = old + ln(5.0)
    loss, clipped = ppo_clip_loss(lp, old, t([-1.0, 1.0]), 0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, t([3.0, -1.2]))
    assert clipped.tolist() == [[CLIP_DUAL, CLIP_HIGH]]  # the dual clip apart from the ceiling
    with pytest.raises(ValueError, match=r"dual_clip \(1.0\) must be > 1"):
        ppo_clip_loss(lp, old, t([-1.0, 1.0]), dual_clip=1.0)


def test_gspo_uses_the_length_normalised_sequence_ratio():
    # row 0: log ratios ln 1.1, ln 0.9 -> s = sqrt(0.99); row 1 (one token + padding): ratio 2 -> clipped
    old = t([-1.0, -1.0], [-1.0, -1.0])
    lp = (old + t([ln(1.1), ln(0.9)], [ln(2.0), 0.0])).requires_grad_(True)
    mask = t([1, 1], [1, 0])
    loss, clipped = gspo_loss(lp, old, t([1.0, 1.0], [1.0, 1.0]), mask, clip_low=0.2, clip_high=0.2)
    s = math.sqrt(0.99)
    torch.testing.assert_close(loss * mask, t([-s, -s], [-1.2, 0.0]))
    assert clipped[0].tolist() == [CLIP_NONE, CLIP_NONE] and clipped[1, 0] == CLIP_HIGH
    # seq-mean-token-mean: d/dlp_t = -A * s / |y| in row 0; 0 in the clipped row
    LOSS_AGG_MODES["seq-mean-token-mean"](loss, mask).backward()
    torch.testing.assert_close(lp.grad, t([-s / 2 / 2, -s / 2 / 2], [0.0, 0.0]))


def test_gspo_clamps_the_sequence_log_ratio_at_10_as_verl_does():
    # A negative advantage with a mean log-ratio of 12 (tokens 11 and 13): verl clamps the log of
    # s_i at 10, so the loss is exp(10) ~ 22,026 per token, not exp(12) ~ 162,755 (a clamp at 20).
    old = t([-1.0, -1.0], [-1.0, -1.0])
    lp = old + t([11.0, 13.0], [ln(2.0), 0.0])
    mask = t([1, 1], [1, 1])
    loss, _ = gspo_loss(lp, old, t([-1.0, -1.0], [-1.0, -1.0]), mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss[0], torch.full((2,), math.exp(10.0)))
    torch.testing.assert_close(loss[1], torch.full((2,), math.sqrt(2.0)))  # below the clamp: untouched


def test_cispo_clips_a_stop_gradient_weight_and_keeps_every_gradient():
    # ratio 2 -> weight 1.2; ratio 0.5 -> 0.5. loss = -w * A * logprobs; d/dlp = -w * A
    old = t([-1.0, -1.0])
    lp = (old + t([ln(2.0), ln(0.5)])).requires_grad_(True)
    loss, clipped = cispo_loss(lp, old, t([1.0, 1.0]), clip_high=0.2)
    torch.testing.assert_close(loss, -t([1.2, 0.5]) * lp.detach())
    assert clipped.tolist() == [[CLIP_HIGH, CLIP_NONE]]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, t([-1.2, -0.5]))


# --- corrections ------------------------------------------------------------------------------


def test_truncated_is_token_and_sequence():
    prox = t([-1.0, -1.0], [-1.0, -1.0])
    mu = prox - t([ln(3.0), ln(0.5)], [ln(2.0), ln(1.5)])
    mask = torch.ones(2, 2)
    anchor, w, keep = CORRECTIONS["tis"](prox, mu, mask, level="token", cap=2.0)
    assert anchor is prox and torch.equal(keep, mask)
    torch.testing.assert_close(w, t([2.0, 0.5], [2.0, 1.5]))
    # sequence: row 0 product 1.5, row 1 product 3 -> min(3, cap)
    _, w, _ = CORRECTIONS["tis"](prox, mu, mask, level="sequence", cap=2.0)
    torch.testing.assert_close(w, t([1.5, 1.5], [2.0, 2.0]))
    _, w, _ = CORRECTIONS["tis"](prox, mu, mask, level="sequence", cap=5.0)
    torch.testing.assert_close(w, t([1.5, 1.5], [3.0, 3.0]))


def test_masked_is_drops_tokens_or_sequences_outside_the_bounds():
    prox = t([-1.0, -1.0, -1.0])
    mu = prox - t([ln(0.4), ln(1.0), ln(3.0)])
    mask = t([1, 1, 1])
    _, w, keep = CORRECTIONS["mis"](prox, mu, mask, level="token", low=0.5, high=2.0)
    assert keep.tolist() == [[0.0, 1.0, 0.0]]
    torch.testing.assert_close(w, t([0.0, 1.0, 0.0]))
    # sequence: product 1.2 is inside [0.5, 2]: every token kept, weight 1.2
    _, w, keep = CORRECTIONS["mis"](prox, mu, mask, level="sequence", low=0.5, high=2.0)
    assert keep.tolist() == [[1.0, 1.0, 1.0]]
    torch.testing.assert_close(w, t([1.2, 1.2, 1.2]))


def test_decoupled_none_and_behaviour_ppo():
    prox = t([-1.0, -1.0])
    mu = prox - t([ln(10.0), ln(0.5)])
    mask = t([1, 1])
    _, w, _ = CORRECTIONS["decoupled"](prox, mu, mask, cap=None)
    torch.testing.assert_close(w, t([10.0, 0.5]))
    _, w, _ = CORRECTIONS["decoupled"](prox, mu, mask, cap=5.0)
    torch.testing.assert_close(w, t([5.0, 0.5]))
    anchor, w, _ = CORRECTIONS["none"](prox, mu, mask)
    assert anchor is prox and torch.equal(w, torch.ones_like(mask))
    anchor, w, _ = CORRECTIONS["behaviour_ppo"](prox, mu, mask)
    assert anchor is mu and torch.equal(w, torch.ones_like(mask))


def test_sapo_gate_is_the_plain_gradient_on_policy_and_fades_off_it():
    # r = 1: f = sigmoid(0) * 4 / tau = 2 / tau; d f / d r = 1, so d loss / d lp = -A
    old = t([-1.0, -1.0, -1.0])
    lp = (old + t([0.0, 0.0, ln(2.0)])).requires_grad_(True)
    adv = t([1.0, -1.0, 1.0])
    loss, clipped = sapo_loss(lp, old, adv, tau_pos=1.0, tau_neg=1.05)
    sig = 1 / (1 + math.exp(-1.0))  # sigmoid(tau_pos * (2 - 1))
    torch.testing.assert_close(loss, t([-2.0, 2.0 / 1.05, -4.0 * sig]))
    assert clipped.tolist() == [[CLIP_NONE] * 3]  # a soft gate clips nothing
    loss.sum().backward()
    # ratio 2: d/dlp = -A * 4 sigmoid'(1) * r = -4 * sig * (1 - sig) * 2, well under the plain -2
    torch.testing.assert_close(lp.grad, t([-1.0, 1.0, -8.0 * sig * (1 - sig)]))
    with pytest.raises(ValueError, match=r"tau_pos \(0.0\) and tau_neg \(1.05\) must be > 0"):
        sapo_loss(lp, old, adv, tau_pos=0.0)


def test_gmpo_takes_the_geometric_mean_of_log_clipped_ratios():
    # row 0, A = +1: log ratios ln 2 (above clip_high 0.4: cut to 0.4), ln 0.5 -> R = exp((0.4 - ln 2) / 2)
    # row 1, A = -1: log ratios ln 0.5 (below -0.4: raised to -0.4), padding -> R = exp(-0.4)
    old = t([-1.0, -1.0], [-1.0, -1.0])
    lp = (old + t([ln(2.0), ln(0.5)], [ln(0.5), 5.0])).requires_grad_(True)
    adv = t([1.0, 1.0], [-1.0, -1.0])
    mask = t([1, 1], [1, 0])
    loss, clipped = gmpo_loss(lp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    r0, r1 = math.exp((0.4 - ln(2.0)) / 2), math.exp(-0.4)
    torch.testing.assert_close(loss * mask, t([-r0, -r0], [r1, 0.0]))
    assert clipped[0].tolist() == [CLIP_HIGH, CLIP_NONE] and clipped[1, 0] == CLIP_LOW
    # seq-mean-token-mean: the mean over sequences of -A_i R_i; d/dlp_t = -A R / |y| where unclipped
    agg = LOSS_AGG_MODES["seq-mean-token-mean"](loss, mask)
    assert agg.item() == pytest.approx((-r0 + r1) / 2)
    agg.backward()
    torch.testing.assert_close(lp.grad, t([0.0, -r0 / 2 / 2], [0.0, 0.0]))


def test_clip_fractions_and_ppo_kl_parts_keep_the_sides_apart():
    # tokens: A=+1 ratio 1.5 (ceiling), A=-1 ratio 0.5 (floor), A=-1 ratio 5 (dual), A=+1 ratio 1 (none)
    prox = t([-1.0, -1.0, -2.0, -1.0])
    lp = prox + t([ln(1.5), ln(0.5), ln(5.0), 0.0])
    adv = t([1.0, -1.0, -1.0, 1.0])
    algo = AlgorithmConfig(correction="none", dual_clip=3.0)
    _, parts = compute_policy_loss(lp, prox, prox, adv, torch.ones(1, 4), algo)
    assert parts["clipped"].tolist() == [[1.0, 1.0, 0.0, 0.0]]  # the dual clip is not in clipfrac
    assert parts["clipped_high"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert parts["clipped_low"].tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert parts["clipped_dual"].tolist() == [[0.0, 0.0, 1.0, 0.0]]
    # ppo_kl is the mean of -log_ratio: (-ln 1.5 + ln 2 - ln 5 + 0) / 4
    assert (-parts["log_ratio"]).mean().item() == pytest.approx((-ln(1.5) + ln(2.0) - ln(5.0)) / 4, rel=1e-5)


def test_log_linear_proximal_interpolates_by_version():
    mu = t([-2.0], [-2.0], [-2.0])
    lp = t([-1.0], [-1.0], [-1.0])
    # behaviour versions 0, 2, 4; proximal 3; current 4: alpha = 3/4, 1/2, and 1 (no gap)
    out = log_linear_proximal_logprobs(mu, lp, torch.tensor([0, 2, 4]), proximal_version=3, current_version=4)
    torch.testing.assert_close(out, t([-1.25], [-1.5], [-1.0]))
    # one step per batch (proximal == current): exactly pi_theta
    out = log_linear_proximal_logprobs(mu, lp, torch.tensor([0, 2, 4]), proximal_version=4, current_version=4)
    torch.testing.assert_close(out, lp)


# --- aggregation ------------------------------------------------------------------------------


def test_aggregation_modes_by_hand():
    loss = t([1.0, 2.0, 3.0], [4.0, 9.0, 9.0])
    mask = t([1, 1, 1], [1, 0, 0])
    assert LOSS_AGG_MODES["token-mean"](loss, mask).item() == pytest.approx(10 / 4)
    assert LOSS_AGG_MODES["seq-mean-token-sum"](loss, mask).item() == pytest.approx((6 + 4) / 2)
    assert LOSS_AGG_MODES["seq-mean-token-mean"](loss, mask).item() == pytest.approx((2 + 4) / 2)
    assert LOSS_AGG_MODES["seq-mean-token-sum-norm"](loss, mask, norm_tokens=4).item() == pytest.approx(10 / 8)
    assert LOSS_AGG_MODES["token-sum"](loss, mask).item() == pytest.approx(10)
    assert aggregate(loss, mask, "token-sum", num_tokens=99, num_seqs=7).item() == pytest.approx(10)
    with pytest.raises(ValueError, match=r"aggregation mode \('sum'\) must be one of"):
        aggregate(loss, mask, "sum")


def test_a_fully_masked_row_counts_as_a_sequence_of_loss_0_in_the_seq_mean_modes():
    loss = t([1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0])
    mask = t([1, 1, 1], [1, 0, 0], [0, 0, 0])  # row 2: every token masked
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)  # not counted at all
    assert aggregate(loss, mask, "token-sum").item() == pytest.approx(10)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4 + 0) / 3)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4 + 0) / 3)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_tokens=4).item() == pytest.approx(10 / 12)
    # given num_seqs, the caller's count decides
    assert aggregate(loss, mask, "seq-mean-token-mean", num_seqs=2).item() == pytest.approx((2 + 4) / 2)


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_aggregation_over_micro_batches_sums_to_the_batch(mode):
    torch.manual_seed(0)
    loss = torch.randn(5, 4)
    mask = (torch.rand(5, 4) > 0.3).float()
    mask[:, 0] = 1
    full = LOSS_AGG_MODES[mode](loss, mask, norm_tokens=4)
    parts = sum(
        LOSS_AGG_MODES[mode](loss[lo:hi], mask[lo:hi], num_tokens=mask.sum(), num_seqs=5, norm_tokens=4)
        for lo, hi in ((0, 2), (2, 5))
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


# --- the reduction property -------------------------------------------------------------------


def _random_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(3, 5, generator=g) * 3
    lp = (prox + 0.3 * torch.randn(3, 5, generator=g)).requires_grad_(True)  # some tokens clip
    adv = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    return lp, prox, adv, mask


# Every combination the config accepts (gspo with token-level tis/mis is rejected at start).
VALID_COMBINATIONS = [
    (loss, correction, level)
    for loss in sorted(POLICY_LOSSES)
    for correction in sorted(CORRECTIONS)
    for level in ("token", "sequence")
    if not (loss == "gspo" and level == "token" and correction in ("tis", "mis"))
]


@pytest.mark.parametrize("policy_loss, correction, level", VALID_COMBINATIONS)
def test_every_correction_reduces_to_plain_ppo_when_mu_is_the_learner(policy_loss, correction, level):
    """mu == pi_prox (fresh samples, no sampler mismatch): w == 1, nothing masked, anchor == pi_prox."""
    clip = {"gspo": (3e-2, 4e-2)}.get(policy_loss, (0.2, 0.28))
    base = dict(policy_loss=policy_loss, clip_low=clip[0], clip_high=clip[1], correction_level=level)
    lp, prox, adv, mask = _random_case()
    loss, parts = compute_policy_loss(lp, prox, prox.clone(), adv, mask, AlgorithmConfig(**base, correction=correction))
    (grad,) = torch.autograd.grad(loss, lp)
    plain, _ = compute_policy_loss(lp, prox, prox.clone(), adv, mask, AlgorithmConfig(**base, correction="none"))
    (plain_grad,) = torch.autograd.grad(plain, lp)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grad, plain_grad)
    torch.testing.assert_close(parts["weight"] * mask, mask)
    torch.testing.assert_close(parts["keep"], mask)
    if policy_loss == "ppo_clip":  # and plain PPO is exactly ppo_clip_loss, token-mean
        by_hand, _ = ppo_clip_loss(lp, prox, adv, clip[0], clip[1])
        assert loss.item() == pytest.approx(((by_hand * mask).sum() / mask.sum()).item(), rel=1e-6)


def test_stale_samples_make_the_corrections_differ():
    lp, prox, adv, mask = _random_case(1)
    mu = prox - torch.linspace(-1.5, 1.5, 15).reshape(3, 5)  # weights from e^-1.5 to e^1.5
    losses = {
        c: compute_policy_loss(lp, prox, mu, adv, mask, AlgorithmConfig(correction=c, is_cap=2.0))[0].item()
        for c in CORRECTIONS
    }
    assert len({round(v, 6) for v in losses.values()}) == len(CORRECTIONS) - 1  # tis == decoupled at one cap
    assert losses["tis"] == pytest.approx(losses["decoupled"])


def test_log_linear_proximal_interpolates_each_token_by_its_own_version():
    """A generation spanning versions 1 and 3 (then 4): each segment is interpolated with the
    alpha of the version that sampled it, alpha = (v_prox - v_mu) / (v_theta - v_mu)."""
    T = 6
    completion = Completion(
        prompt_ids=np.array([1, 2], dtype=np.int32),
        response_ids=np.arange(3, 3 + T, dtype=np.int32),
        logprobs=np.full(T, -2.0, dtype=np.float32),
        text="",
        finish_reason="length",
        version_segments=[[0, 1], [2, 3], [5, 4]],
    )
    row = {"group_id": "g", "prompt_uid": "p", "task": "t", "text": "", "answer": ""}
    (group,) = build_groups([row], [[completion]], version=0, generator="gen", rollout_s=0.0)
    assert group.policy_version == 1 and group.samples[0].version_segments == [[0, 1], [2, 3], [5, 4]]
    batch = collate([group], [[1.0]], pad_id=0)
    logprobs = torch.full_like(batch.behaviour_logprobs, -1.0)
    out = log_linear_proximal_logprobs(
        batch.behaviour_logprobs, logprobs, batch.behaviour_version, proximal_version=4, current_version=5
    )
    response = out[0][batch.response_mask[0] > 0]
    # mu = -2, pi_theta = -1: log pi_prox = -2 + alpha; alpha = 3/4 (v1), 1/2 (v3), 0 (v4)
    torch.testing.assert_close(response, torch.tensor([-1.25, -1.25, -1.5, -1.5, -1.5, -2.0]))
    # one version for the whole row would have given every token the oldest segment's alpha
    whole = log_linear_proximal_logprobs(batch.behaviour_logprobs, logprobs, batch.policy_version, 4, 5)
    torch.testing.assert_close(whole[0][batch.response_mask[0] > 0], torch.full((T,), -1.25))
