"""The trl side of ``asyncrl bench vs-trl``: an asyncrl recipe trained by trl 1.16's ``GRPOTrainer``.

    python -m asyncrl.benchmarks.vs_trl.trl_grpo RECIPE OUT_JSON [dotted overrides ...] [--eval-every K]

Synchronous, one process, on this CPU, with Hugging Face ``generate`` (trl's vLLM colocate mode
does not run with this CPU build of vLLM: ``trl_objective.VLLM_COLOCATE``): trl as a user would run it,
on exactly what the recipe trains: the model folder ``model.path`` (the harness passes one already
warm-started, with ``model.warm_start=false``), the run's training prompts as asyncrl renders them
(``load_run_prompts``) in its dispatcher's seeded order, its rule rewards, and its objective mapped
key by key (``asyncrl.benchmarks.vs_trl.trl_objective`` says how and where the two still differ).

The clock: ``ASYNCRL_BENCH_T0`` (a ``time.time()`` the harness takes just before it starts this
process; the process's start without it) is 0. Held-out accuracy is greedy exact match on the
run's evaluation prompts (``load_eval_prompts``, ``eval.num_prompts`` of them; ``hf_eval``'s
decoding, ``eval.max_new_tokens``), scored by the run's evaluation reward (``EvalScorer``): before
training, every ``--eval-every`` steps and after the last. Evaluations are timed and taken off the
clock: every ``t`` below is seconds from T0 *minus the evaluation time so far*, so the curve is
the time training alone took. The result is one JSON object, ``TrlResult``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from asyncrl.benchmarks.vs_trl import trl_objective
from asyncrl.models.hf_eval import greedy_generate

RENDEZVOUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torch.distributed's environment rendezvous, which trl's one process must not inherit."""
EVAL_BATCH = 250
"""Prompts per greedy decoding batch."""


@dataclasses.dataclass
class TrlResult:
    """What ``OUT_JSON`` holds. Times in seconds from T0 with evaluation time taken off, unless named."""

    curve: list[dict]
    """Held-out accuracy: {"step", "accuracy" in [0, 1], "t", "t_from_first_step" (t - t_first_step;
    0 for the entry before training), "eval_s" (that evaluation's own seconds)}; step 0 is before."""
    steps: list[dict]
    """Per optimizer step: {"step", "t", "samples", "completion_tokens", "loss", "grad_norm", "reward"}."""
    t_first_step: float
    """The first optimizer step done (= setup_s)."""
    setup_s: float
    """T0 to the first step done: imports, model, data, trl's set-up and one step."""
    train_s: float
    """The training phase: trl's training loop start to the last step done."""
    wall_s: float
    """T0 to the end, evaluation excluded."""
    wall_with_eval_s: float
    """T0 to the end, evaluation included."""
    eval_total_s: float
    """Every evaluation's seconds (and the weight-change measurement) together."""
    samples: int
    """Completions trained on."""
    completion_tokens: int
    """Their tokens (trl's completion mask: up to and with the eos)."""
    samples_per_s: float
    """samples / train_s."""
    tokens_per_s: float
    """completion_tokens / train_s."""
    setup_marks: dict
    """Where set-up went, t when each was done: "imported" (torch, transformers, trl), "data_loaded"
    (config, model, prompts, rewards), "trainer_built" (trl's ``GRPOTrainer``)."""
    mean_abs_param_change: float
    """Mean |w_end - w_start| over every trainable weight: proof the policy moved."""
    sampler: str
    """"generate" (Hugging Face ``generate``; the only one that runs here)."""
    sampler_note: str
    """Why not vLLM (``trl_objective.VLLM_COLOCATE``)."""
    versions: dict
    """trl, transformers and torch versions."""
    trl_config: dict
    """The ``GRPOConfig`` values set (``trl_objective.grpo_settings``)."""


class HeldOut:
    """Greedy exact match of a model on the held-out prompts, scored by the run's evaluation reward."""

    def __init__(self, cfg, model_dir: str, tokenizer):
        from asyncrl.rewards.evaluation import EvalScorer, eval_reward_specs
        from asyncrl.tasks.eval_sets import load_eval_prompts

        self.prompts, _sets = load_eval_prompts(cfg, model_dir)
        self.tokenizer = tokenizer
        self.max_new_tokens = cfg.eval.max_new_tokens
        self.correct_at = cfg.eval.correct_at
        self.timeout_s = cfg.eval.score_timeout_s
        self.scorer = EvalScorer(eval_reward_specs(cfg), cfg.task.metadata_by_task())

    def accuracy(self, model) -> float:
        was_training = model.training
        model.eval()
        tok = self.tokenizer
        answers = []
        for start in range(0, len(self.prompts), EVAL_BATCH):
            chunk = self.prompts[start : start + EVAL_BATCH]
            ids = [tok(p.text, add_special_tokens=False)["input_ids"] for p in chunk]
            for out in greedy_generate(model, ids, self.max_new_tokens, tok.eos_token_id, tok.pad_token_id):
                finish = "length" if len(out) == self.max_new_tokens else "stop"
                answers.append([(tok.decode(out, skip_special_tokens=True), finish)])
        values = self.scorer.submit(self.prompts, answers).result(self.timeout_s)
        model.train(was_training)
        correct = [v is not None and v[0] is not None and v[0] >= self.correct_at for v in values]
        return sum(correct) / len(correct)


class Clock:
    """Seconds from T0 with the evaluation time taken off (``off`` times what is excluded)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.excluded = 0.0

    def now(self) -> float:
        return time.time() - self.t0 - self.excluded

    def off(self, fn):
        start = time.time()
        value = fn()
        took = time.time() - start
        self.excluded += took
        return value, took


class BenchCallback(TrainerCallback):
    """Records each step and evaluates the held-out prompts before, every ``every`` steps and after."""

    def __init__(self, clock: Clock, heldout: HeldOut, reward: trl_objective.RunReward, every: int):
        self.clock, self.heldout, self.reward, self.every = clock, heldout, reward, every
        self.curve: list[dict] = []
        self.steps: list[dict] = []
        self.t_train_start = self.t_first_step = None
        self.start_weights: list[torch.Tensor] = []
        self.param_change = 0.0

    def _evaluate(self, step: int, model) -> None:
        t = self.clock.now()
        accuracy, took = self.clock.off(lambda: self.heldout.accuracy(model))
        since = 0.0 if self.t_first_step is None else t - self.t_first_step
        self.curve.append({"step": step, "accuracy": accuracy, "t": t, "t_from_first_step": since, "eval_s": took})
        print(f"[trl] step {step}: held-out accuracy {accuracy:.3f} at t={t:.1f}s (eval {took:.1f}s)", flush=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def snapshot():
            self.start_weights = [p.detach().clone() for p in model.parameters() if p.requires_grad]

        self.clock.off(snapshot)
        self._evaluate(0, model)
        self.t_train_start = self.clock.now()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        t = self.clock.now()
        if self.t_first_step is None:
            self.t_first_step = t
        self.steps.append(
            {"step": state.global_step, "t": t, "samples": self.reward.samples, "completion_tokens": self.reward.tokens}
        )
        self.reward.samples = self.reward.tokens = 0
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._evaluate(state.global_step, model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.steps and self.steps[-1]["step"] == state.global_step and logs:
            for key, name in (("loss", "loss"), ("grad_norm", "grad_norm"), ("reward", "reward")):
                if key in logs:
                    self.steps[-1][name] = float(logs[key])

    def on_train_end(self, args, state, control, model=None, **kwargs):
        def change() -> float:
            now = [p.detach() for p in model.parameters() if p.requires_grad]
            total = sum(float((a - b).abs().sum()) for a, b in zip(now, self.start_weights))
            return total / sum(p.numel() for p in now)

        self.param_change, _ = self.clock.off(change)
        self.start_weights = []


def process_start() -> float:
    """This process's start as a ``time.time()`` epoch, to 10 ms (Linux's /proc; elsewhere now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # start, since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def run(recipe: str, overrides: list[str], every: int) -> TrlResult:
    """Train the recipe's run with trl and measure it (see the module's docstring)."""
    clock = Clock(float(os.environ.get("ASYNCRL_BENCH_T0") or process_start()))
    # One process, no process group: a rank's rendezvous inherited from whoever started this (a
    # launcher, a test worker whose in-process learner set them) would make accelerate open a
    # group on a port that caller still holds.
    for key in RENDEZVOUS_ENV:
        os.environ.pop(key, None)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.tasks.prompts import load_run_prompts

    marks = {"imported": clock.now()}
    cfg = load_config(recipe, overrides)
    trl_objective.check_mappable(cfg)
    model_dir = str(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    count = cfg.learner.total_steps * cfg.learner.batch_groups
    rows = trl_objective.prompt_rows(load_run_prompts(cfg, "train", model_dir), cfg.run.seed, count)
    reward = trl_objective.RunReward(cfg)
    callback = BenchCallback(clock, HeldOut(cfg, model_dir, tokenizer), reward, every)
    marks["data_loaded"] = clock.now()
    settings = trl_objective.grpo_settings(cfg)
    with tempfile.TemporaryDirectory(prefix="trl_grpo_") as out_dir:  # trl wants one; nothing is saved
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=trl.GRPOConfig(output_dir=out_dir, **settings),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[callback],
            optimizers=trl_objective.optimizer_and_schedule(model, cfg),
        )
        for quiet in (ProgressCallback, PrinterCallback):  # the per-step dicts are in OUT_JSON instead
            trainer.remove_callback(quiet)
        marks["trainer_built"] = clock.now()
        trainer.train()
    reward.close()
    callback.heldout.scorer.close()
    wall = clock.now()
    samples = sum(s["samples"] for s in callback.steps)
    tokens = sum(s["completion_tokens"] for s in callback.steps)
    train_s = callback.steps[-1]["t"] - callback.t_train_start
    return TrlResult(
        curve=callback.curve,
        steps=callback.steps,
        t_first_step=callback.t_first_step,
        setup_s=callback.t_first_step,
        train_s=train_s,
        wall_s=wall,
        wall_with_eval_s=wall + clock.excluded,
        eval_total_s=clock.excluded,
        samples=samples,
        completion_tokens=tokens,
        samples_per_s=samples / train_s,
        tokens_per_s=tokens / train_s,
        setup_marks=marks,
        mean_abs_param_change=callback.param_change,
        sampler="generate",
        sampler_note=trl_objective.VLLM_COLOCATE,
        versions={"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        trl_config=settings,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.benchmarks.vs_trl.trl_grpo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("recipe", help="the asyncrl recipe, e.g. configs/demo.yaml")
    parser.add_argument("out_json", help="where the result (TrlResult) is written")
    parser.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE, as for `asyncrl train`")
    parser.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every K steps (default 20)")
    args = parser.parse_args(argv)
    if args.eval_every < 1:
        parser.error(f"--eval-every ({args.eval_every}) must be >= 1")
    result = run(args.recipe, args.overrides, args.eval_every)
    Path(args.out_json).write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
    first, last = result.curve[0], result.curve[-1]
    print(
        f"[trl] held-out {first['accuracy']:.3f} -> {last['accuracy']:.3f}; wall {result.wall_s:.1f}s "
        f"(with eval {result.wall_with_eval_s:.1f}s), setup {result.setup_s:.1f}s, "
        f"{result.train_s / max(1, len(result.steps)):.2f} s/step; {args.out_json}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
