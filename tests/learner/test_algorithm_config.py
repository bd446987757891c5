"""``algorithm`` section: defaults, and incompatible combinations fail at start naming the keys."""

import pytest

from asyncrl.config import load_config
from asyncrl.learner.config import AlgorithmConfig


def test_defaults_are_decoupled_grpo_and_the_demo_loads():
    a = AlgorithmConfig()
    assert (a.adv_estimator, a.policy_loss, a.correction, a.loss_agg_mode) == (
        "grpo",
        "ppo_clip",
        "decoupled",
        "token-mean",
    )
    cfg = load_config("configs/demo.yaml")
    assert cfg.algorithm.correction == "decoupled" and cfg.algorithm.is_cap == 5.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"adv_estimator": "gae"}, r"algorithm.adv_estimator 'gae' needs a critic"),
        (
            {"policy_loss": "gspo", "correction": "tis"},
            r"algorithm.policy_loss 'gspo' is sequence-level: algorithm.correction 'tis' needs algorithm.correction_level 'sequence'",
        ),
        (
            {"policy_loss": "cispo", "dual_clip": 3.0},
            r"algorithm.dual_clip \(3.0\) applies to policy_loss 'ppo_clip' only",
        ),
        ({"dual_clip": 0.5}, r"algorithm.dual_clip \(0.5\) must be > 1"),
        ({"correction": "tis", "is_cap": None}, r"algorithm.correction 'tis' needs algorithm.is_cap"),
        ({"is_cap": 0.5}, r"algorithm.is_cap \(0.5\) must be >= 1"),
        ({"mis_low": 2.0, "mis_high": 1.0}, r"algorithm.mis_high \(1.0\) must be > algorithm.mis_low \(2.0\)"),
        ({"kl": {"controller": "adaptive"}}, r"algorithm.kl.controller 'adaptive' needs algorithm.kl.coef > 0"),
        ({"kl": {"coef": -1.0}}, r"kl.coef \(-1.0\) must be >= 0"),
        ({"correction": "vtrace"}, r"correction"),
        ({"pass_k": 4}, r"algorithm.pass_k \(4\) is set but algorithm.adv_estimator 'grpo' does not use it"),
        ({"std_estimator": "bessel"}, r"std_estimator"),
        (
            {"policy_loss": "gmpo", "adv_estimator": "gae", "critic": {"lr": 1e-4}},
            r"algorithm.policy_loss 'gmpo' needs one advantage per sequence",
        ),
        ({"sapo_tau_neg": 0.0}, r"sapo_tau_neg"),
        ({"reinforce_pp_whitening": "batch"}, r"reinforce_pp_whitening"),
        ({"kl_entropy_agg_mode": "mean"}, r"kl_entropy_agg_mode"),
        ({"clip_hgih": 0.3}, r"clip_hgih"),
    ],
)
def test_incompatible_or_bad_settings_name_the_keys(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**kwargs)


def test_group_estimators_need_a_group():
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator 'rloo' needs sampling.n >= 2"):
        load_config(None, ["algorithm.adv_estimator=rloo", "sampling.n=1"])
    assert load_config(None, ["algorithm.adv_estimator=reinforce_pp", "sampling.n=1"]).sampling.n == 1


def test_pass_at_k_needs_k_answers_per_group():
    with pytest.raises(ValueError, match=r"algorithm.pass_k \(8\) must be <= sampling.n \(4\)"):
        load_config(None, ["algorithm.adv_estimator=pass_at_k", "algorithm.pass_k=8", "sampling.n=4"])
    cfg = load_config(None, ["algorithm.adv_estimator=pass_at_k", "algorithm.pass_k=4", "sampling.n=4"])
    assert cfg.algorithm.pass_k == 4
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator 'opo' needs sampling.n >= 2"):
        load_config(None, ["algorithm.adv_estimator=opo", "sampling.n=1"])


def test_the_references_defaults():
    a = AlgorithmConfig()
    assert (a.std_estimator, a.reinforce_pp_whitening, a.kl_entropy_agg_mode) == ("population", "token", None)


def test_remax_needs_the_generators_greedy_answers():
    with pytest.raises(ValueError, match=r"'remax' needs .* set generator.greedy_baseline: true"):
        load_config(None, ["algorithm.adv_estimator=remax"])
    cfg = load_config(None, ["algorithm.adv_estimator=remax", "generator.greedy_baseline=true"])
    assert cfg.algorithm.adv_estimator == "remax"


def test_gspo_with_sequence_level_correction_is_accepted():
    a = AlgorithmConfig(
        policy_loss="gspo", correction="mis", correction_level="sequence", clip_low=3e-4, clip_high=4e-4
    )
    assert a.correction_level == "sequence"


@pytest.mark.parametrize(
    "recipe",
    [
        "grpo_addition",
        "reinforce_pp_addition",
        "ppo_critic_addition",
        "grpo_gsm8k",
        "reinforce_pp_gsm8k",
        "ppo_critic_gsm8k",
    ],
)
def test_recipes_load(recipe):
    cfg = load_config(f"configs/{recipe}.yaml")
    assert cfg.algorithm.adv_estimator in ("grpo", "reinforce_pp_baseline", "gae")
