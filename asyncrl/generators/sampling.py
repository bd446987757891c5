"""How each group is sampled: the ``sampling`` config, vLLM's ``SamplingParams`` and the seeds.

Every option here keeps the behaviour logprobs vLLM returns (``logprobs_mode=
"processed_logprobs"``, ``asyncrl.generators.engines.vllm_engine``) equal to the distribution the learner
recomputes (``asyncrl.learner.logprobs``: temperature, then top-k, then top-p). What each allowed
option does to the tokens, as vLLM 0.32 does it:

- **Stop strings** (``stop``) are matched on the decoded text; vLLM drops any token sampled after
  the one that completed the string, so ``response_ids`` end with that token, each with the
  logprob it was sampled with, and all of them are trained. Only ``text`` is cut: before the stop
  string, or after it with ``include_stop_str_in_output``. The finish reason is ``stop``.
- **Stop token ids** (``stop_token_ids``) end an answer like EOS: the stop token stays the last of
  ``response_ids`` (the decision to stop is trained), its text is left out of ``text`` unless
  ``include_stop_str_in_output``.
- **Seeds.** Every request carries a seed derived from the run's seed and the group's id
  (``request_seed``); vLLM gives sample i of the group ``seed + i``. Group ids are the
  dispatcher's sequence numbers (``g00000012``), so the same run seed samples the same group with
  the same noise whichever generator takes it, and a group sent again (after a restart) replays it
  under the same weights; what still varies is which weights sampled it (the run records them).

Refused in training (``asyncrl.generators.config.REFUSED``), each with its reason: ``min_tokens`` and the repetition,
presence and frequency penalties. They change the distribution vLLM samples from, and reports
logprobs of, at each position by what was generated before it (the penalties: by the counts of
the tokens so far; ``min_tokens``: by masking EOS and the stop tokens for the first tokens), which
the learner's recomputation does not reproduce, so its importance ratios would be wrong there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from asyncrl.generators.config import REFUSED as REFUSED  # re-exported
from asyncrl.generators.config import SamplingConfig


def sampling_params(sampling: SamplingConfig, num_prompts: int, seed: int | list[int] | None, **extra) -> list:
    """One vLLM ``SamplingParams`` per prompt: ``sampling``'s settings, the sampled token's logprob
    only, and a seed: a list gives each prompt its own (``request_seed``), an int gives each one
    derived from (seed, prompt index), None leaves them unseeded. ``extra`` goes to every one (the
    async engine asks for ``output_kind``; benchmarks for ``min_tokens``, ``ignore_eos``)."""
    from vllm import SamplingParams

    if isinstance(seed, list) and len(seed) != num_prompts:
        raise ValueError(f"seed: {len(seed)} seeds given for {num_prompts} prompts: one per prompt")
    return [
        SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
            logprobs=0,  # only the sampled token's logprob
            seed=_seed_of(seed, index),
            **extra,
        )
        for index in range(num_prompts)
    ]


def _seed_of(seed: int | list[int] | None, index: int) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, list):
        return int(seed[index])
    return derive_seed(seed, index)


@dataclass(frozen=True)
class AnswerOptions:
    """How one prompt of an evaluation is answered (``VLLMEngine.answer``): greedily (``temperature``
    0, ``n`` 1) or ``n`` times sampled, with the run's stop strings and stop token ids."""

    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= 1")
        if self.temperature == 0.0 and self.n != 1:
            raise ValueError(f"n ({self.n}) must be 1 for greedy answers (temperature 0)")


def answer_params(options: AnswerOptions, **extra):
    """vLLM ``SamplingParams`` of ``options`` (``extra``: e.g. the async engine's ``output_kind``)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=options.n,
        temperature=options.temperature,
        top_p=options.top_p if options.temperature > 0 else 1.0,
        max_tokens=options.max_tokens,
        seed=options.seed,
        stop=list(options.stop) or None,
        stop_token_ids=list(options.stop_token_ids) or None,
        include_stop_str_in_output=options.include_stop_str_in_output,
        **extra,
    )


def greedy_params(max_tokens: int, **extra):
    """vLLM ``SamplingParams`` of argmax decoding up to ``max_tokens`` (for evaluation)."""
    from vllm import SamplingParams

    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1")
    return SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, **extra)


def derive_seed(seed: int, index: int) -> int:
    """An independent 31-bit seed per (seed, prompt index); vLLM adds the child index to it."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint32)[0] >> 1)


def request_seed(run_seed: int, group_id: str) -> int:
    """The 31-bit seed of group ``group_id``'s request in a run seeded ``run_seed`` (the module
    docstring says why by group id): a stable hash of the id (not Python's ``hash``, which is
    salted per process for strings) mixed with the run's seed.

    >>> request_seed(0, "g00000012") == request_seed(0, "g00000012") != request_seed(1, "g00000012")
    True
    """
    digest = int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest(), "little")
    return derive_seed(run_seed, digest)
