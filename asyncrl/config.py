"""The root config of a run: one section per component, each section's class next to its code.

The sections of the process roles (and of the fleet) are each in their package's ``config``
module, which declares them and imports nothing else of its package (a contract in
``pyproject.toml``). So this module sits below the roles in the layers: every role's context
types it, annotations included, and none of them depends on another role through it.

``load_config(recipe, overrides)`` reads a YAML recipe, applies dotted overrides
(``learner.total_steps=20``), validates (a typo names the key), and the controller writes the
resolved result to ``RUN_DIR/config.yaml``, which every process reads back, so a run is
reproducible from that file and its seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

# AutoStalenessConfig (the buffer's ``auto_staleness``) is named here for the learner, which runs that
# controller: a role reads another role's section through the root config, not from that role's package.
from asyncrl.buffer.config import AutoStalenessConfig as AutoStalenessConfig
from asyncrl.buffer.config import BufferConfig
from asyncrl.configbase import Config, apply_overrides, load_yaml
from asyncrl.dispatcher.config import DispatcherConfig
from asyncrl.fleet.config import LauncherConfig, PlacementConfig, SupervisionConfig
from asyncrl.generators.config import (
    AgentConfig,
    EngineConfig,
    EnvironmentConfig,
    GeneratorConfig,
    MockEngineConfig,
    SamplingConfig,
)
from asyncrl.learner.config import AlgorithmConfig, LearnerConfig, MockTrainerConfig
from asyncrl.models.lora import LoraConfig
from asyncrl.models.sft import SFTConfig
from asyncrl.models.tiny import TinyModelConfig
from asyncrl.observability.loggers import LoggingConfig
from asyncrl.rewards.config import RewardConfig, eval_reward_specs
from asyncrl.rundir.checkpoints import CheckpointConfig
from asyncrl.tasks.eval_config import EvalConfig
from asyncrl.tasks.prompts import TaskConfig
from asyncrl.weights.config import WeightSyncConfig
from asyncrl.wire.security import SecurityConfig


class RunSection(Config):
    name: str = "run"
    """Run name; the run directory is ``{root}/{name}``."""
    root: str = "runs"
    """Folder that holds run directories (relative to the working directory)."""
    seed: int = 0
    """Seed of everything random: model init, SFT, prompt order, sampling."""
    num_generators: int = Field(2, ge=1)
    """Generator processes, each owning one vLLM engine."""
    overwrite: bool = True
    """Replace an existing run directory of the same name instead of refusing to start."""
    startup_timeout_s: float = Field(300, gt=0)
    """Seconds every process has to report ready before the run is aborted, plus ``startup_s_per_gib``
    per GiB of the model's weight files (engines and DeepSpeed load and place every byte)."""
    startup_s_per_gib: float = Field(60, ge=0)
    """Seconds of start-up allowed per GiB of model weights on top of ``startup_timeout_s``."""
    stall_timeout_s: float = Field(120, gt=0)
    """Floor of the stall bound: seconds without a learner step that are never a stall
    (``asyncrl.controller.watchdog``: the bound is ``stall_factor`` × the slowest interval between steps so far,
    clamped to [``stall_timeout_s``, ``stall_cap_s``]); past the bound the controller aborts,
    naming what each process waits for."""
    stall_factor: float = Field(5.0, ge=1)
    """How many times the slowest interval between learner steps seen so far a step may take before the run is stalled."""
    stall_cap_s: float = Field(3600, gt=0)
    """Ceiling of the stall bound: a run with no learner step for this long is stopped, however slow its steps were."""
    first_step_timeout_s: float = Field(900, gt=0)
    """Bound of the first interval (go to the first step: first batch sampled and trained, engines
    warming up), when no step has been measured yet; clamped like the stall bound."""
    malloc_trim_s: float = Field(30, ge=0)
    """Seconds between two ``malloc_trim(0)`` calls in the controller and every component process, which give the C
    allocator's free pages back to the kernel (``asyncrl.fleet.malloc_trim``; in the demo's soak a
    vLLM generator's resident set stood 40-50 MiB lower with them); 0: never."""
    console: Literal["live", "plain", "quiet", "jsonl"] = "live"
    """Progress on stdout: live (a panel redrawn in place; plain when stdout is not a terminal), plain (a line per step), quiet, jsonl (a JSON object per step)."""


class ModelSection(Config):
    path: str | None = None
    """A Hugging Face model directory to train, or a known model's name (``smollm2-135m-instruct``, ``-bfloat16`` for that dtype), fetched and converted into the cache if missing (``asyncrl model fetch``); None builds the tiny model below."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the tiny Qwen2 built when ``path`` is None."""
    warm_start: bool = True
    """Run the SFT warm start (``sft`` section) before RL."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (``peft``) on the frozen model instead of all its weights, and publish only the adapters (``asyncrl.models.lora``); set any key (``model.lora.rank=16``) to enable. None: full fine-tuning."""


class SimulationConfig(Config):
    """Simulated engines behind the real interfaces, for benchmarking the control plane."""

    generator: MockEngineConfig | None = None
    """Replace each generator's vLLM engine by this timing model (None: real vLLM)."""
    learner: MockTrainerConfig | None = None
    """Replace the DeepSpeed trainer by this timing model (None: real training); no model is
    built, warmed up or evaluated then."""
    evaluate: bool = False
    """Let simulated generators answer held-out evaluation requests (their answers are right with
    the engine's ``accuracy``): the evaluation path, tested without a model. Off: no evaluation."""


class RunConfig(Config):
    run: RunSection = RunSection()
    """Where the run lives, its seed, how many processes."""
    task: TaskConfig = TaskConfig()
    """Which prompts to train and evaluate on."""
    model: ModelSection = ModelSection()
    """Which model to train."""
    sft: SFTConfig = SFTConfig()
    """The supervised warm start."""
    engine: EngineConfig = EngineConfig()
    """The vLLM engine of each generator."""
    sampling: SamplingConfig = SamplingConfig()
    """How answers are sampled (group size n, temperature, length)."""
    generator: GeneratorConfig = GeneratorConfig()
    """The generator loop."""
    environment: EnvironmentConfig = EnvironmentConfig()
    """Multi-turn episodes with an environment and tools (none: single-turn answers)."""
    agent: AgentConfig = AgentConfig()
    """Episodes played by an agent program through the OpenAI-compatible gateway (none: no agent)."""
    dispatcher: DispatcherConfig = DispatcherConfig()
    """Prompt dispatch; admission uses ``buffer.max_staleness`` and ``learner.batch_groups``."""
    reward: RewardConfig = RewardConfig()
    """The reward worker."""
    buffer: BufferConfig = BufferConfig()
    """The replay buffer (its ``max_staleness`` is the run's staleness bound)."""
    learner: LearnerConfig = LearnerConfig()
    """The learner loop and its trainer."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """What the learner optimises: advantage estimator, policy loss, off-policy correction, KL, entropy."""
    weights: WeightSyncConfig = WeightSyncConfig()
    """How and when the learner's weights reach the generators (transport, buckets, schedule, probe)."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation by the generators' engines: before, during and after RL."""
    logging: LoggingConfig = LoggingConfig()
    """Step metrics to TensorBoard (RUN_DIR/tensorboard) and Weights & Biases (when installed), by learner version."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """When checkpoints of the whole run are written and how many are kept."""
    supervision: SupervisionConfig = SupervisionConfig()
    """What happens when a component process dies."""
    simulation: SimulationConfig = SimulationConfig()
    """Simulated generators and learner (benchmarks); off by default."""
    launcher: LauncherConfig = LauncherConfig()
    """Where the components run: local processes (default) or Ray actors on a cluster."""
    placement: PlacementConfig = PlacementConfig()
    """Per-role resources and node labels on a Ray cluster (``launcher.kind: ray``)."""
    security: SecurityConfig = SecurityConfig()
    """Message-size limits of every receiving socket; ZeroMQ CURVE (off by default; keys by path only)."""

    @model_validator(mode="after")
    def _check_algorithm(self) -> RunConfig:
        self.algorithm.check_run(
            group_size=self.sampling.n,
            greedy_baseline=self.generator.greedy_baseline,
            max_tokens=self.sampling.max_tokens,
            auto_staleness=self.buffer.auto,
        )
        if self.algorithm.distill is not None:  # every group needs its teacher's logprobs
            untaught = [
                f"reward.by_task.{task}" if task else "reward.rewards"
                for task, specs in self.reward.specs_by_task().items()
                if not any(spec.kind == "teacher" for spec in specs)
            ]
            if untaught:
                raise ValueError(
                    f"algorithm.distill needs a reward of kind teacher in {untaught} (e.g. "
                    "{kind: teacher, options: {path: TEACHER_DIR}})"
                )
        return self

    @model_validator(mode="after")
    def _resolve_apply_mode(self) -> RunConfig:
        """``weights.apply_mode: null`` -> ``in_flight`` with continuous generation, else
        ``between_requests``, written into the resolved config; continuous generation never stops
        between requests, so it cannot wait for that moment to swap weights."""
        continuous = self.generator.mode == "continuous"
        if self.weights.apply_mode is None:
            self.weights.apply_mode = "in_flight" if continuous else "between_requests"
        elif continuous and self.weights.apply_mode != "in_flight":
            raise ValueError(
                f"weights.apply_mode ({self.weights.apply_mode}) must be in_flight with generator.mode continuous: "
                "requests run without a pause between them (use generator.mode batch for between_requests)"
            )
        return self

    @model_validator(mode="after")
    def _check_partial_rollouts(self) -> RunConfig:
        """``generator.partial_rollouts: resume`` interrupts answers still running at a weight
        update: only continuous generation swaps weights while answers run, and an answer is
        interrupted for being past the staleness bound, so there must be one."""
        if self.generator.partial_rollouts != "resume":
            return self
        if self.generator.mode != "continuous":
            raise ValueError(
                f"generator.partial_rollouts (resume) needs generator.mode continuous, not {self.generator.mode}: "
                "the batch mode swaps weights between requests, so no answer runs across an update"
            )
        if self.buffer.max_staleness is None:
            raise ValueError(
                "generator.partial_rollouts (resume) needs buffer.max_staleness (null): answers are resumed "
                "for being past the staleness bound"
            )
        return self

    @property
    def plays_episodes(self) -> bool:
        """Groups are multi-turn episodes: of an environment (``environment.cls``) or of an agent
        program through the gateway (``agent.command``)."""
        return self.environment.cls is not None or self.agent.command is not None

    @model_validator(mode="after")
    def _check_environment(self) -> RunConfig:
        """Episodes (an environment's, or an agent program's) run on vLLM's async engine, one
        request a turn (either scheduler), not on the simulated engine, and held-out episodes are
        played by the generators; they are not given ReMax's greedy baseline, and an agent's calls
        are not resumed across updates. An episode has an environment or an agent, not both."""
        if self.environment.cls is not None and self.agent.command is not None:
            raise ValueError(
                f"environment.cls ({self.environment.cls}) and agent.command ({self.agent.command}) are both set: "
                "an episode is played by an environment or by an agent program, set one"
            )
        if not self.plays_episodes:
            return self
        gen, ev = self.generator, self.eval
        rules = [
            ("simulation.generator", "set", self.simulation.generator is None, "must be null: vLLM plays episodes"),
            (
                "generator.partial_rollouts",
                gen.partial_rollouts,
                gen.partial_rollouts != "resume" or self.agent.command is None,
                "must not be resume yet (an agent's call is not resumed)",
            ),
            ("generator.greedy_baseline", gen.greedy_baseline, not gen.greedy_baseline, "must be false"),
            ("eval.engine", ev.engine, ev.engine == "generators", "must be generators: they play held-out episodes"),
        ]
        for key, value, ok, rule in rules:
            if not ok:
                player = (
                    f"environment.cls ({self.environment.cls})"
                    if self.environment.cls is not None
                    else f"agent.command ({self.agent.command})"
                )
                raise ValueError(f"{key} ({value}) {rule}, with {player}")
        return self

    @model_validator(mode="after")
    def _check_admission_lead(self) -> RunConfig:
        # Under auto the bound moves within [min, max]: the lead must fit the lowest.
        auto = self.buffer.auto
        ahead = self.dispatcher.ahead_versions
        bound = self.buffer.auto_staleness.min if auto else self.buffer.max_staleness
        name = "buffer.auto_staleness.min" if auto else "buffer.max_staleness"
        if ahead is not None and bound is not None and ahead > bound:
            raise ValueError(
                f"dispatcher.ahead_versions ({ahead}) must be <= {name} ({bound}): groups "
                "dispatched further ahead could not be trained within the staleness bound"
            )
        margin = self.weights.staleness_margin
        if auto and self.weights.schedule == "staleness" and bound - margin < 1:
            raise ValueError(
                f"buffer.auto_staleness.min ({bound}) minus weights.staleness_margin ({margin}) must be >= 1 "
                "under weights.schedule staleness: at a lower bound no publication could keep samples within it"
            )
        return self

    @model_validator(mode="after")
    def _check_publication_keeps_up(self) -> RunConfig:
        """Under ``weights.schedule: every_k`` the generators serve a version up to
        ``broadcast_every - 1`` steps behind the learner, and the dispatcher admits groups against
        the version they serve (``asyncrl.dispatcher.admission``): the learner at version v needs
        groups sampled at v - s or later, so with a bound s < broadcast_every - 1 nothing can be
        admitted for it and the run waits for work forever. Under auto the lowest bound counts."""
        if self.weights.schedule != "every_k":
            return self
        auto = self.buffer.auto
        bound = self.buffer.auto_staleness.min if auto else self.buffer.max_staleness
        name = "buffer.auto_staleness.min" if auto else "buffer.max_staleness"
        every = self.learner.broadcast_every
        if bound is not None and every - 1 > bound:
            raise ValueError(
                f"learner.broadcast_every ({every}) must be <= {name} ({bound}) + 1: the generators serve a "
                f"version up to {every - 1} steps behind the learner, past the staleness bound, so no group "
                "could be admitted for the next step and the run would never progress (publish more often, "
                "or allow more staleness)"
            )
        return self

    @model_validator(mode="after")
    def _check_zero_variance_filter(self) -> RunConfig:
        zv, estimator = self.buffer.zero_variance, self.algorithm.adv_estimator
        if not zv.drop:
            return self
        if estimator in ("remax", "reinforce_pp", "gae"):
            raise ValueError(
                f"buffer.zero_variance.drop needs a group-relative advantage; algorithm.adv_estimator ({estimator!r}) "
                "gives a group whose answers all score alike advantages other than 0 (a greedy baseline, the "
                "batch's statistics, a critic), so dropping it throws a signal away"
            )
        names = [spec.label for spec in self.reward.rewards]
        if zv.reward is not None and zv.reward not in names:
            raise ValueError(
                f"buffer.zero_variance.reward ({zv.reward!r}) must name one of the run's rewards {names} "
                "(reward.rewards), or be null for the combined reward"
            )
        return self

    @model_validator(mode="after")
    def _check_stall_bounds(self) -> RunConfig:
        if self.run.stall_cap_s < self.run.stall_timeout_s:
            raise ValueError(
                f"run.stall_cap_s ({self.run.stall_cap_s}) must be >= run.stall_timeout_s ({self.run.stall_timeout_s}): "
                "the cap of the stall bound cannot be below its floor"
            )
        return self

    @model_validator(mode="after")
    def _resolve_probe_atol(self) -> RunConfig:
        """``weights.probe_atol: null`` -> the tolerance of the engine's and the trainer's dtypes,
        written into the resolved config so every process checks against the same number."""
        if self.weights.probe_atol is None:
            from asyncrl.weights.probe import probe_tolerance

            self.weights.probe_atol = probe_tolerance(self.engine.dtype, self.learner.trainer.dtype)
        return self

    @model_validator(mode="after")
    def _check_weights_dtype(self) -> RunConfig:
        if self.weights.dtype != "model" and self.weights.dtype != self.engine.dtype:
            raise ValueError(
                f"weights.dtype ({self.weights.dtype}) must be model or the engine's dtype (engine.dtype "
                f"{self.engine.dtype}): the engine would serve weights rounded to {self.weights.dtype} that the "
                "learner's probe does not expect"
            )
        return self

    @model_validator(mode="after")
    def _check_learner_ranks(self) -> RunConfig:
        if self.learner.ranks > 1 and self.simulation.learner is not None:
            raise ValueError(
                f"learner.ranks ({self.learner.ranks}) must be 1 with simulation.learner: a simulated learner "
                "has no data-parallel group"
            )
        sp = self.learner.sequence_parallel
        if sp > 1 and (self.algorithm.adv_estimator == "gae" or self.algorithm.objective == "online_dpo"):
            raise ValueError(
                f"learner.sequence_parallel ({sp}) runs the policy-gradient step without a critic: "
                f"algorithm.adv_estimator '{self.algorithm.adv_estimator}' with algorithm.objective "
                f"'{self.algorithm.objective}' needs learner.sequence_parallel 1"
            )
        return self

    @model_validator(mode="after")
    def _check_rewards_by_task(self) -> RunConfig:
        """Each task's rewards exist for it, and those that compare with the reference answer
        score only tasks that have one (``task.data.answer_key`` not None)."""
        names = self.task.task_names()
        unknown = [name for name in self.reward.by_task if name not in names]
        if unknown:
            raise ValueError(f"reward.by_task {unknown} must name tasks of this run: {names}")
        views = self.task.source_tasks() if self.task.sources else [self.task]
        for task in views:
            if task.data.answer_key is not None or (task.name == "addition" and task.data.train is None):
                continue
            needs = [s.label for s in self.reward.by_task.get(task.name, self.reward.rewards) if s.kind in NEED_ANSWER]
            if needs:
                raise ValueError(
                    f"task {task.name!r} has no reference answer (data.answer_key is None), but its rewards "
                    f"{needs} compare with one: give them reward.by_task.{task.name}, or set its answer_key"
                )
        return self

    @model_validator(mode="after")
    def _check_eval(self) -> RunConfig:
        """Evaluation sets belong to tasks of the run, and each task's evaluation reward exists and
        runs in the controller (``asyncrl.rewards.evaluation``)."""
        from asyncrl.tasks.eval_sets import check_eval_sets

        check_eval_sets(self.eval.sets, self.task)
        if self.eval.engine == "generators":
            eval_reward_specs(self)
        return self

    @model_validator(mode="after")
    def _check_placement(self) -> RunConfig:
        self.placement.check_counts(self.run.num_generators, self.learner.ranks)
        gpus, tp = self.placement.generator.num_gpus, self.engine.tensor_parallel_size
        if gpus and max(gpus, 1) != tp:
            raise ValueError(
                f"placement.generator.num_gpus ({gpus}) must equal engine.tensor_parallel_size ({tp}): "
                "a generator's engine spans the GPUs of its actor (a fraction of one only when tp is 1)"
            )
        util = self.engine.gpu_memory_utilization
        if 0 < gpus < 1 and self.engine.kv_cache_memory_bytes is None and util > gpus:
            raise ValueError(
                f"engine.gpu_memory_utilization ({util}) must be at most placement.generator.num_gpus ({gpus}): "
                "vLLM takes that share of the whole device, which the generator shares with others"
            )
        if self.launcher.bind_host == "node" and self.weights.transport == "shm":
            raise ValueError(
                "weights.transport (shm) shares /dev/shm of one host; with launcher.bind_host node the "
                "generators may be on other machines: use zmq (or file on shared storage)"
            )
        return self


NEED_ANSWER = ("exact_match", "math_verify")
"""Reward kinds that compare a completion with the row's reference answer."""


def load_config(recipe: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    data = load_yaml(recipe) if recipe else {}
    return RunConfig(**apply_overrides(data, list(overrides)))


def load_run_config(path: str | Path) -> RunConfig:
    return RunConfig(**load_yaml(path))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
