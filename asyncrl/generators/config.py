"""The generators' sections of the run's config: ``generator`` (the loop), ``engine`` (vLLM),
``sampling`` and ``simulation.generator`` (the simulated engine). Declarations only: the root
config (``asyncrl.config``) imports this module and nothing else of the generators.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configbase import Config, import_class


class GeneratorConfig(Config):
    mode: Literal["continuous", "batch"] = "continuous"
    """``continuous``: keep up to ``max_inflight_sequences`` sequences in the engine, ask for more
    prompts as soon as room frees and send each group the moment its n answers are done
    (``asyncrl.generators.schedulers.continuous``); weights are then swapped in flight. ``batch``: ask for
    ``prompts_per_batch`` prompts, sample them in one engine call and send them when the slowest
    answer is done (the batch barrier, kept for comparison)."""
    prompts_per_batch: int = Field(16, ge=1)
    """batch: prompts a generator asks for and samples in one engine call (each gives a group of
    n). continuous: the simulated engine's default bound is this many groups of n."""
    max_inflight_sequences: int | None = Field(None, ge=1)
    """continuous: most sequences (n per group, ReMax's greedy answer included) a generator keeps in
    its engine. None: what the engine's KV cache holds, KV blocks // ceil(expected_sequence_tokens /
    block size) (vLLM reports its blocks once started), at most ``engine.max_num_seqs``;
    ``prompts_per_batch`` groups for the simulated engine. Either way it is a ceiling: the bound
    shrinks by a quarter when the engine runs out of KV cache (sequences preempted or waiting for
    blocks) and grows back one group at a time once that stops."""
    expected_sequence_tokens: int | None = Field(None, ge=1)
    """continuous: tokens (prompt + answer) one sequence is expected to hold, for the default
    ``max_inflight_sequences``. None: ``engine.max_model_len``, the most any can reach, so no
    sequence is preempted; a smaller figure (e.g. the usual prompt + the median answer) keeps more
    sequences in flight and leaves the tail to the preemption back-off."""
    group_timeout_s: float | None = Field(None, gt=0)
    """continuous: seconds a group may stay in the engine; past it its requests are aborted and the
    group is dropped, reason ``generation_timeout``, named in the log (an engine never holds
    sequences forever). None: scaled to the model, 8 x ``sampling.max_tokens`` x the seconds per
    token the engine has taken (averaged over finished groups), at least 30 s, and 600 s until a
    group has finished (``asyncrl.generators.schedulers.continuous.GroupTimeout``)."""
    dispatcher_silence_s: float = Field(30.0, gt=0)
    """continuous: seconds without an answer from the dispatcher after which the silence is logged
    by name (the sequences in flight go on and are sent; nothing waits on the dispatcher)."""
    request_timeout_s: float = Field(0.25, gt=0)
    """Seconds a request for prompts waits before it is asked again, with the version then served
    (short, because the dispatcher's admission is computed from the version in the request)."""
    greedy_baseline: bool = False
    """Also decode each prompt greedily and send that answer with its group (``Group.greedy_text``),
    for ReMax's baseline; the reward worker scores it into ``Group.greedy_reward``."""
    send_timeout_s: float = Field(30.0, gt=0)
    """Seconds a finished group waits for a reward worker to take it before the wait is reported."""
    partial_rollouts: Literal["off", "mask", "resume"] = "off"
    """What becomes of an answer whose oldest tokens are past ``buffer.max_staleness`` when it is
    trained: ``off``, its whole group is dropped (reason ``stale``); ``mask``, the stale tokens
    stay as context but leave the loss (``Sample.trained_from``), the group being dropped only when
    none of its tokens is within the bound; ``resume``, as ``mask``, and a request still running
    at a weight update is also aborted and resumed under the new version from its tokens so far
    (AReaL's interruptible generation, ``asyncrl.generators.resume``)."""


class EnvironmentConfig(Config):
    """Multi-turn episodes: an environment answers each model turn (``asyncrl.generators.rollouts``)."""

    cls: str | None = None
    """The environment, ``module:Class`` (an ``Environment``, or a ``ToolEnvironment`` whose
    methods are its tools), one instance per episode. None: single-turn answers."""
    options: dict = Field(default_factory=dict)
    """Keyword arguments of the class."""
    max_turns: int = Field(4, ge=1)
    """Model turns an episode may take; one that reaches it without the environment ending it
    ends with finish reason ``length``."""
    max_episode_tokens: int | None = Field(None, ge=1)
    """Tokens after the prompt (the model's and the environment's) an episode may hold; each turn
    samples at most ``sampling.max_tokens`` of them. None: what ``engine.max_model_len`` leaves
    after the prompt."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Seconds the environment may take to answer a turn (or to reset, or close); past it the
    episode ends unscored, reason ``environment_timeout``."""
    tool_format: Literal["hermes", "tag"] | None = None
    """How a ``ToolEnvironment``'s tools are called in the model's text
    (``asyncrl.tasks.environments.tool_calls``). None: the class's own ``tool_format``."""
    plain_template: str | None = None
    """How the environment's messages are rendered for a model without a chat template (the
    demo's): ``{content}`` (and ``{role}``) in a string, e.g. ``"\\n{content}\\n"``. None: the
    model's chat template (a model without one: the bare content)."""

    @field_validator("cls")
    @classmethod
    def _importable(cls, path: str | None) -> str | None:
        """A wrong path fails when the config is read, naming it, not in a generator's start."""
        if path is not None:
            import_class(path, "environment.cls")
        return path

    @model_validator(mode="after")
    def _options_checked(self) -> EnvironmentConfig:
        """A class that checks its options (``check_options(options)``, as ``HttpEnvironment``)
        does so when the config is read: a typo fails there, naming the key, not in every episode."""
        if self.cls is not None:
            check = getattr(import_class(self.cls, "environment.cls"), "check_options", None)
            if callable(check):
                check(self.options)
        return self


class AgentConfig(Config):
    """An agent program plays each episode; its model calls go through the gateway."""

    command: list[str] | None = None
    """The program's argv, e.g. ``["python", "agents/solve.py"]``, started once per episode with
    the task on stdin and the gateway's URL and token in its environment. None: no agent."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Seconds an episode may last, model calls included; past it the program's process group is
    killed and the episode is unscored, reason ``agent_timeout``."""
    host: str = "127.0.0.1"
    """Address the gateway binds to. The loopback default keeps it to programs on this machine;
    another address exposes the policy to whoever can reach it (each episode still needs its token)."""
    port: int = Field(0, ge=0, le=65535)
    """Port the gateway binds to; 0: any free port (agents get the URL, never guess it)."""
    max_calls: int = Field(64, ge=1)
    """Model calls one episode may make; a call past it is refused (400)."""
    max_request_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body the gateway reads; a larger one is refused (413)."""

    @field_validator("command")
    @classmethod
    def _not_empty(cls, command: list[str] | None) -> list[str] | None:
        if command is not None and (not command or not command[0]):
            raise ValueError(f"command ({command!r}) must name a program (a non-empty argv list) or be None")
        return command


REFUSED = {
    "min_tokens": (
        0,
        "vLLM masks EOS and the stop tokens for the first min_tokens tokens and reports the logprobs "
        "of that masked distribution (logprobs_mode processed_logprobs); the learner scores the "
        "unmasked one, so every ratio there would be off by log(1 - p(stop))",
    ),
    "repetition_penalty": (
        1.0,
        "it rescales the logits of every token already in the prompt or the answer, a per-position "
        "change of the behaviour distribution the learner does not reproduce when it recomputes logprobs",
    ),
    "presence_penalty": (
        0.0,
        "it lowers the logits of every token already in the answer, a per-position change of the "
        "behaviour distribution the learner does not reproduce when it recomputes logprobs",
    ),
    "frequency_penalty": (
        0.0,
        "it lowers the logits of each token by how often the answer has used it, a per-position change "
        "of the behaviour distribution the learner does not reproduce when it recomputes logprobs",
    ),
}
"""vLLM sampling options refused in training: key -> (its neutral value, which is accepted; why)."""


class SamplingConfig(Config):
    """How each group is sampled (``asyncrl.generators.sampling``). ``min_tokens`` and the
    repetition, presence and frequency penalties are refused: they change the behaviour
    distribution at each position in a way the learner's recomputed logprobs do not follow."""

    n: int = 8
    """Samples per prompt (the group size)."""
    temperature: float = 1.0
    """Softmax temperature; must be > 0 (use ``VLLMEngine.greedy`` for argmax decoding)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 turns it off. Computed on the tempered distribution."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 turns it off."""
    max_tokens: int = 4
    """Most tokens per answer (EOS included)."""
    stop: list[str] = []
    """Strings that end an answer: its text is cut before the string, its tokens end with the one
    that completed it (trained, with its logprob; none sampled after it is kept)."""
    stop_token_ids: list[int] = []
    """Token ids that end an answer besides EOS; the stop token stays in the answer's tokens (trained)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or the stop token's text) at the end of the answer's text, which the
    rewards see; the tokens are the same either way."""

    @model_validator(mode="before")
    @classmethod
    def refuse_distribution_changes(cls, data):
        if isinstance(data, dict):
            for key, (neutral, reason) in REFUSED.items():
                if key in data and data[key] != neutral:
                    raise ValueError(f"sampling.{key} ({data[key]!r}) is refused in training: {reason}")
            data = {k: v for k, v in data.items() if k not in REFUSED}
        return data

    @model_validator(mode="after")
    def check_ranges(self) -> SamplingConfig:
        if self.n < 1:
            raise ValueError(f"n ({self.n}) must be >= 1")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature ({self.temperature}) must be > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k ({self.top_k}) must be >= 0 (0 = off)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError(f"stop ({self.stop!r}) must hold non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids ({self.stop_token_ids!r}) must be >= 0")
        return self


class EngineConfig(Config):
    """How one generator process builds its vLLM engine."""

    dtype: Literal["auto", "float32", "bfloat16", "float16", "bfloat16_if_native"] = "float32"
    """Weight and activation dtype (auto: the checkpoint's, vLLM's rule). float32 works everywhere
    (the CPU backend included) and keeps behaviour logprobs within ~1e-5 of a float32 learner;
    bfloat16 is the usual choice on GPUs; bfloat16_if_native is bfloat16 where the generator's
    device multiplies it natively (GPUs of sm_80 and later, CPUs with AVX512-BF16 or AMX) and
    float32 elsewhere, where vLLM emulates it ~30x slower (``asyncrl.models.precision``)."""
    max_model_len: int = 64
    """Longest sequence (prompt + response) in tokens; a prompt that leaves no room is an error."""
    kv_cache_memory_bytes: int | None = 256 << 20
    """KV cache size in bytes. None sizes it from ``gpu_memory_utilization`` (GPU only: the CPU
    backend needs an explicit size). On CPU the env var VLLM_CPU_KVCACHE_SPACE (whole GiB), when a
    user exports it, overrides this value inside vLLM; the run never sets it itself."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use; only read when ``kv_cache_memory_bytes`` is None."""
    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile: faster start-up, slower decoding. Turn off on GPUs for
    long runs."""
    core_start_method: Literal["fork", "spawn"] = "fork"
    """How the engine-core process of the async engine starts. vLLM's CPU backend always asks for
    spawn, and a spawned core imports vLLM again: 11.1 s to a ready engine here, against 2.5 s
    forked (the tiny model, a 2-core AVX2 host, same output). fork keeps vLLM's own rule
    otherwise: it still spawns where CUDA is initialised or inside a Ray actor. spawn: what vLLM
    asks for on the CPU."""
    max_num_seqs: int = 256
    """Most sequences decoded concurrently (a group of n counts n)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (the n samples of a group share their prompt)."""
    block_size: int | None = None
    """KV cache block size in tokens; None is the backend's default (128 on CPU, 16 on CUDA).
    Only whole blocks are prefix-cached, so prompts shorter than a block never hit the cache."""
    seed: int = 0
    """Seed of the engine's sampling RNG, used for requests that pass no seed."""
    enable_chunked_prefill: bool | None = None
    """Let vLLM split a long prefill over several engine steps. None: off on vLLM's CPU backend,
    vLLM's default (on) elsewhere; True on the CPU backend is refused. Why off there: every request
    asyncrl sends carries its own seed (reproducible groups), which gives it its own
    ``torch.Generator``; after each partial prefill step vLLM 0.32 rewinds that generator
    (``set_offset``: the token sampled for a prompt not yet whole is discarded), and a CPU
    generator has no offset, so the engine dies (``EngineDeadError``, "CPU Generator does not use
    offset"). Long prompts arriving together, or the recompute of every running request after an
    in-flight weight swap (~640-token contexts), split prefills. Off, vLLM raises its per-step
    token budget to at least ``max_model_len`` and schedules a prefill only whole, so no seeded
    request is ever split and seeds keep their meaning (dropping the seeds instead would lose
    ``generate(seed=...)``'s reproducibility; a GPU generator rewinds, so it keeps vLLM's default).
    vLLM then logs that disabling chunked prefill is not officially supported for the model: a
    generic warning (vLLM's CPU backend itself turns it off for MLA models and RISC-V)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine shards the model over (vLLM tensor parallelism); on a Ray cluster each
    generator's placement reserves that many GPUs."""
    lora_serving: Literal["auto", "adapter", "merge"] = "auto"
    """With ``model.lora`` (each version only the adapter's tensors): ``adapter`` serves each version
    as a vLLM LoRA adapter (``enable_lora``: loaded in ~0.1 s, but every step pays the LoRA
    kernels); ``merge`` merges it into the base weights on the generator (base + B·A·alpha/r)
    and reloads the targeted matrices (no LoRA kernels; a reload per version); ``auto``: merge on
    vLLM's CPU backend, where LoRA kernels sampled SmolLM2-135M at 0.44 x the merged model's rate
    (bench/lora_sync.py), adapter elsewhere (not measured here). docs/reference/weights.md."""

    @model_validator(mode="after")
    def check_sizes(self) -> EngineConfig:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be >= 2")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes ({self.kv_cache_memory_bytes}) must be > 0 or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization ({self.gpu_memory_utilization}) must be in (0, 1]")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size ({self.block_size}) must be >= 1 or None")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be >= 1")
        return self


class MockEngineConfig(Config):
    """Timing model of a simulated generator engine."""

    overhead_s: float = Field(0.005, ge=0)
    """Fixed cost of one engine call (scheduling, sampling setup)."""
    prefill_s_per_token: float = Field(2e-6, ge=0)
    """Prefill cost per prompt token (prompts of a group are prefilled once each sample)."""
    decode_step_s: float = Field(0.002, ge=0)
    """Cost of one decode step of the whole batch (weights read once per step)."""
    decode_s_per_seq: float = Field(2e-5, ge=0)
    """Extra cost per active sequence in a decode step (attention, sampling)."""
    length_median: float = Field(64, gt=0)
    """Median response length in tokens of the lognormal length distribution."""
    length_sigma: float = Field(1.0, ge=0)
    """Shape of the lognormal: 0 makes every response ``length_median`` long, 1 is long-tailed."""
    lengths: list[int] | None = None
    """An empirical list of response lengths to draw from instead of the lognormal."""
    accuracy: float = Field(0.5, ge=0, le=1)
    """Chance that a sample of an addition prompt answers correctly, so groups carry reward
    variance (other tasks' samples are always wrong: the engine cannot know their answers)."""
    load_weights_s: float = Field(0.01, ge=0)
    """Simulated time to apply a weight update."""
    vocab_size: int = Field(32000, ge=2)
    """Range of the fake token ids."""
    engines_per_process: int = Field(1, ge=1)
    """Simulated engines (generator loops, one thread each) per generator process, so that
    hundreds of generators fit on a few cores (``asyncrl.generators.multiplex``)."""

    @model_validator(mode="after")
    def check_lengths(self) -> MockEngineConfig:
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise ValueError(f"lengths ({self.lengths!r:.60}) must be a non-empty list of ints >= 1")
        return self
