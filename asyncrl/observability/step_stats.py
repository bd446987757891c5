"""``StepStats``: the figures of one learner step, one declared field each.

The learner's ``train_step`` returns a ``StepStats`` (the real trainer: ``asyncrl.learner.step_stats``;
the simulated one: ``asyncrl.learner.mock_trainer``), the learner process adds what the step's batch
says (``reward``, ``accuracy``, ``samples``, ``wait_s``) and the staleness bound it set, and sends it
whole in the ``step`` event (``asyncrl.wire.events.StepEvent``). Every reader takes its figures as
attributes: the console, ``steps.jsonl`` (``record``: one key per field, the names unchanged since the
stats were a map; ``from_record`` reads a line back), TensorBoard (``scalars``), Prometheus
(``asyncrl.observability.metrics``) and ``asyncrl inspect``. A misspelt name is an ``AttributeError`` where it is read and a ``TypeError``
where it is set, and the name lists below are checked against the fields when this module is
imported, so a statistic cannot go missing from a dashboard without a test failing.

The type sits with its readers, below the wire and the learner, so that both can import it.

>>> s = StepStats(version=3, loss=0.5, tokens=120, staleness_mean=1.0, staleness_max=2, clipfrac=0.1)
>>> s.record()["clipfrac"], "entropy" in s.record()  # unmeasured figures (None) are left out
(0.1, False)
>>> StepStats(version=3, loss=0.5, tokens=120, staleness_mean=1.0, staleness_max=2, clipfrc=0.1)
Traceback (most recent call last):
    ...
TypeError: Unexpected keyword argument 'clipfrc'
"""

from __future__ import annotations

from typing import ClassVar

import msgspec


class StepStats(msgspec.Struct, kw_only=True):
    """What one learner step measured (averaged over the step's optimizer updates where they change
    between updates). None: not measured by this trainer or this configuration."""

    version: int
    """The learner's version after the step."""
    loss: float
    """The mean over the step's updates of each update's total loss."""
    tokens: int
    """Response tokens of the step's batch, every one (those kept as context only included:
    ``stale_tokens_masked``)."""
    staleness_mean: float
    """Mean of ``staleness`` (NaN when no sequence was trained)."""
    staleness_max: int
    """Largest of ``staleness`` (0 when none)."""
    step_s: float = 0.0
    """Seconds the step took (``train_step``)."""
    reward: float | None = None
    """Mean reward of the batch's samples, as the reward workers combined it (before any shaping
    of the algorithm's: the overlong penalty, a KL penalty in the reward)."""
    # -- set by the learner process from the step's batch, after ``train_step``
    accuracy: float | None = None
    """Share of the batch a correctness reward scored right; None when no such reward ran
    (``asyncrl.tasks.answers.batch_accuracy``). Kept in ``steps.jsonl`` even when None."""
    samples: int | None = None
    """Samples in the batch."""
    wait_s: float | None = None
    """Seconds the learner waited for the batch."""
    staleness_bound: int | None = None
    """Under ``buffer.max_staleness: auto``: the bound set after this step (for the batches to come)."""
    staleness_bound_reason: str | None = None
    """Under auto, on the steps that changed the bound: why (the signal and its limit)."""
    # -- staleness
    staleness: list[int] = []
    """One int per sequence trained: the version before the step minus the version of its oldest
    trained token (not in ``steps.jsonl``: the Prometheus histogram and the final report count it)."""
    token_staleness: dict[int, int] = {}
    """Response tokens in the loss by the staleness of the version that sampled each."""
    stale_tokens_masked: int = 0
    """Tokens kept as context only, past the staleness bound (``Sample.trained_from``)."""
    stale_samples_masked: int = 0
    """Samples with no token trained (every one past the staleness bound)."""
    # -- the optimizer
    updates: int | None = None
    """Optimizer updates taken, all steps."""
    policy_loss: float | None = None
    """The policy term of the loss, per update."""
    lr: float | None = None
    """The learning rate of the step's last update."""
    grad_norm: float | None = None
    """Mean global gradient norm before clipping."""
    grad_norm_max: float | None = None
    """Largest global gradient norm before clipping."""
    grad_clipped: float | None = None
    """Share of the step's updates whose gradient was clipped."""
    grad_clip_coef: float | None = None
    """Mean factor clipping scaled the gradient by, min(1, grad_clip / grad_norm)."""
    loss_by_update: list[float] | None = None
    """Each update's loss, when the step takes several."""
    grad_norm_by_update: list[float] | None = None
    """Each update's gradient norm, when the step takes several."""
    # -- the policy loss (``asyncrl.learner.policy_losses``)
    clipfrac: float | None = None
    """Kept tokens whose ratio was cut at its ceiling or floor (the dual clip is ``clipfrac_dual``)."""
    clipfrac_high: float | None = None
    """Kept tokens cut at the ratio's ceiling."""
    clipfrac_low: float | None = None
    """Kept tokens cut at the ratio's floor."""
    clipfrac_dual: float | None = None
    """Kept tokens cut by the dual clip."""
    approx_kl: float | None = None
    """k3 estimate of KL between the ratio's anchor and pi_theta over kept tokens (0 for a step's first update)."""
    ppo_kl: float | None = None
    """Mean of -log(pi_theta / anchor) over kept tokens (verl's and OpenRLHF's ``ppo_kl``)."""
    clipfrac_by_epoch: list[float] | None = None
    """``clipfrac`` of each epoch, when ``ppo_epochs > 1``."""
    approx_kl_by_epoch: list[float] | None = None
    """``approx_kl`` of each epoch, when ``ppo_epochs > 1``."""
    entropy: float | None = None
    """Token-mean entropy of pi_theta."""
    # -- the off-policy correction
    is_weight_mean: float | None = None
    """Mean of pi_prox / mu per token, before truncation."""
    is_weight_max: float | None = None
    """Largest pi_prox / mu, before truncation."""
    is_weight_ess: float | None = None
    """Effective sample size of the applied weights over response tokens, (Σw)² / (N·Σw²), in (0, 1]."""
    masked_frac: float | None = None
    """Response tokens dropped by the correction."""
    behaviour_kl: float | None = None
    """k3 estimate of KL(mu ‖ pi_prox) over every response token."""
    behaviour_ess: float | None = None
    """ESS of the raw importance weights pi_prox / mu over the batch's tokens, (Σw)² / (N·Σw²)."""
    behaviour_kl_by_staleness: dict[int, float] | None = None
    """Staleness -> mean k3 KL(mu ‖ pi_prox) per token of the samples that stale."""
    mismatch_kl: float | None = None
    """``behaviour_kl`` over the tokens sampled by the version before the step only: the
    sampler/learner mismatch at one version (NaN when there are none)."""
    # -- the batch
    sequences: int | None = None
    """Sequences in the loss."""
    truncated_frac: float | None = None
    """Samples cut off at the length limit."""
    overlong_penalty: float | None = None
    """The overlong penalty's mean (truncation mode ``penalise``)."""
    outside_truncation_frac: float | None = None
    """Response tokens outside pi_theta's top-k/top-p set (0 without top-k/top-p)."""
    padding_frac: float | None = None
    """Padding / token slots of the micro batches' forward passes (``asyncrl.learner.packing``)."""
    # -- multi-turn episodes: set by the learner process from the batch's ``Sample.episode``s
    # (``asyncrl.learner.step_report.episode_figures``); None on a batch of single-turn answers
    episodes: int | None = None
    """Episodes in the batch (an episode of several parts, linked by ``Episode.id``, counts once)."""
    episode_turns: float | None = None
    """Mean model turns per episode."""
    episode_tool_calls: float | None = None
    """Mean tool calls per episode."""
    episode_tool_errors: float | None = None
    """Mean tool calls per episode that ended in an error observation."""
    episode_tokens: float | None = None
    """Mean length of an episode in response tokens, the model's and the environment's, all its parts."""
    episode_masked_tokens: float | None = None
    """Mean tokens per episode out of the loss as context (``loss_mask`` 0: the environment's
    observations, tool results, the chat template's turn markup)."""
    episode_masked_frac: float | None = None
    """Those tokens' share of every response token of the batch (single-turn answers' included):
    out of the loss by design, unlike ``masked_frac``'s."""
    episode_env_failed: float | None = None
    """Share of the episodes the environment failed (``env_error``: it raised or timed out); those
    the ``environment`` reward scores are dropped unscored before the learner, so 0 then."""
    # -- online DPO (``algorithm.objective: online_dpo``, ``asyncrl.learner.online_dpo``)
    dpo_pairs: int | None = None
    """(chosen, rejected) pairs the step trained, drawn from its groups by reward."""
    dpo_groups_unpaired: int | None = None
    """Groups of the batch that gave no pair (every answer scored alike, within ``dpo.min_reward_gap``): trained on nothing."""
    dpo_accuracy: float | None = None
    """Share of the pairs whose chosen answer had the higher implicit reward, before each update."""
    dpo_margin: float | None = None
    """Mean implicit reward margin, beta (log-ratio of chosen - log-ratio of rejected), before each update."""
    dpo_chosen_reward: float | None = None
    """Mean implicit reward of the chosen answers, beta (log pi_theta - log pi_ref), before each update."""
    dpo_rejected_reward: float | None = None
    """Mean implicit reward of the rejected answers, before each update."""
    # -- the KL reference and the critic
    ref_kl: float | None = None
    """Token-mean KL to the reference policy, when one is used."""
    kl_coef: float | None = None
    """The KL coefficient of the step, when a reference is used."""
    value_loss: float | None = None
    """The critic's loss (gae)."""
    value_clipfrac: float | None = None
    """Share of the critic's values clipped (gae)."""
    value_mean: float | None = None
    """The critic's mean value before the step (gae)."""
    return_mean: float | None = None
    """Mean return the critic was fitted to (gae)."""

    NOT_RECORDED: ClassVar[tuple[str, ...]] = ("staleness",)
    """Fields left out of ``record`` (one value per sequence: counted elsewhere)."""
    NOT_CURVES: ClassVar[tuple[str, ...]] = ("version",)
    """Numbers ``scalars`` leaves out (the x axis)."""

    def record(self) -> dict:
        """The step as a JSON-able map (``steps.jsonl``, the ``jsonl`` console): every field that
        was measured (not None; ``accuracy`` always), less ``NOT_RECORDED``."""
        out = msgspec.to_builtins(self)
        return {k: v for k, v in out.items() if k not in self.NOT_RECORDED and (v is not None or k == "accuracy")}

    @classmethod
    def from_record(cls, record: dict) -> StepStats:
        """The stats of a ``steps.jsonl`` line (``record``'s output, read back with ``json``): its
        other keys (``type``, ``source``, ``t``...) ignored, map keys back to ints. A line that is
        not a step's (a required field missing or mistyped) raises ``msgspec.ValidationError``."""
        return msgspec.convert(record, cls, strict=False)

    def scalars(self) -> dict[str, float]:
        """The step's numbers as ``train/NAME`` -> value (TensorBoard, W&B): every int or float
        field that was measured, less ``NOT_CURVES`` (lists, maps and text left out)."""
        out = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name not in self.NOT_CURVES and isinstance(value, int | float) and not isinstance(value, bool):
                out[f"train/{name}"] = float(value)
        return out


def check_names(names, where: str) -> tuple[str, ...]:
    """``names``, each of them a ``StepStats`` field; raises ``AttributeError`` naming ``where``
    otherwise. Readers that list statistics by name call it at import."""
    names = tuple(names)
    unknown = [n for n in names if n not in StepStats.__struct_fields__]
    if unknown:
        raise AttributeError(f"{where}: {unknown} are not StepStats fields (asyncrl.observability.step_stats)")
    return names


check_names(StepStats.NOT_RECORDED + StepStats.NOT_CURVES, "StepStats")
