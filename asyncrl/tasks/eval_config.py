"""The run's ``eval`` section: held-out evaluation by the generators' engines (declarations only).

How rounds run is ``asyncrl.tasks.heldout``'s; what their figures are, ``asyncrl.tasks.eval_metrics``'s.
The section lives apart from both so that the root config and an evaluation round
(``asyncrl.tasks.eval_round``) import it without the evaluator that runs the rounds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Config
from asyncrl.tasks.eval_sets import EvalSetConfig


class EvalConfig(Config):
    """Held-out evaluation (the run's ``eval`` section)."""

    num_prompts: int = Field(500, ge=1)
    """Held-out prompts (the first of the task's test split) scored in each evaluation."""
    max_new_tokens: int = Field(4, ge=1)
    """Most tokens of each evaluation answer (greedy and sampled); the run's stop strings and stop
    token ids (``sampling.stop``, ``sampling.stop_token_ids``) end them as in training."""
    samples_k: int = Field(0, ge=0)
    """Answers sampled per prompt beside the greedy one, at ``temperature``: mean@k and pass@k
    (``asyncrl.tasks.eval_metrics``). 0: greedy only."""
    temperature: float = Field(1.0, gt=0)
    """Softmax temperature of the sampled answers."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass of the sampled answers (1 turns it off)."""
    reward: str | None = None
    """The reward whose value says whether an answer is correct: a name (or kind) of each task's
    rewards (``reward.rewards``, ``reward.by_task``). None: a task's first exact_match or
    math_verify reward, else its first python reward. Rule and python kinds only."""
    reward_by_task: dict[str, str] = Field(default_factory=dict)
    """``reward`` for one task (a source of a mix) by its name, e.g. ``{words: word_reward}``."""
    correct_at: float = 1.0
    """An answer is correct when its reward value is at least this."""
    sets: list[EvalSetConfig] = Field(default_factory=list)
    """More evaluation sets scored in every round beside the task's own split, each reported
    under its name (``asyncrl.tasks.eval_sets``)."""
    score_timeout_s: float = Field(600.0, gt=0)
    """Seconds the controller gives the rewards to score one request's answers; past it the round fails."""
    engine: Literal["generators", "hf"] = "generators"
    """Who decodes: the generators' engines, between training batches (the served weights, the
    engines' dtype); or ``hf``, Hugging Face on the controller's CPU in float32 (small models only,
    before and after RL only)."""
    before: bool = True
    """Evaluate the initial weights (as served) before the RL phase opens: ``eval_before``."""
    overlap_before: bool = True
    """Run that first round beside the first learner steps instead of before them: the
    controller says go at once, and the generators keep serving the starting weights (a
    publication waits) until the round is answered or its bound has passed
    (``asyncrl.generators.weights_hold``), so it still scores version 0. False: every process
    waits for the round before go (its seconds kept apart from the RL wall time)."""
    after: bool = True
    """Evaluate the final weights once every generator serves them: ``eval_after``."""
    every_versions: int | None = Field(None, ge=0)
    """Also evaluate during training, each time the learner reaches a multiple of this many
    versions, without pausing it (None or 0: only before and after)."""
    chunk_prompts: int = Field(64, ge=1)
    """Prompts per evaluation request (one engine call of a generator)."""
    max_outstanding: int = Field(1, ge=1)
    """Requests of a round out at once, per generator."""
    timeout_floor_s: float = Field(60.0, gt=0)
    """Seconds every request is given at least, on top of its decoding allowance."""
    timeout_factor: float = Field(5.0, ge=1)
    """Decoding allowance of a request: this many times ``max_new_tokens`` × the slowest seconds per token measured."""
    initial_s_per_token: float = Field(0.5, gt=0)
    """Seconds per generated token assumed before one is measured (generous: a 7 B model on a GPU
    takes ~0.02-0.1 s per decoding step, a 0.5 B one on two CPU cores ~0.1-0.3 s)."""
    max_retries: int = Field(1, ge=0)
    """Times a request past its timeout is offered again before its round fails."""

    @model_validator(mode="after")
    def check_engine(self) -> EvalConfig:
        if self.engine == "hf" and (self.samples_k or self.sets):
            raise ValueError(
                f"eval.samples_k ({self.samples_k}) and eval.sets ({len(self.sets)}) need eval.engine: generators; "
                "hf decodes greedily and scores the task's own split only"
            )
        return self

    @property
    def periodic(self) -> bool:
        return bool(self.every_versions)
