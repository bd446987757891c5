"""The offline training loop: ``asyncrl sft`` and ``asyncrl dpo`` on the learner's DeepSpeed engine.

``OfflineLoop(cfg, run_dir, model_dir).run(resume)`` builds what RL's ``PolicyTrainer`` builds
(the process group, the Hugging Face model in a DeepSpeed engine at ``learner.trainer``'s ZeRO
stage and precision, AdamW, the learning rate set by hand from ``asyncrl.learner.lr_schedule`` at
each update), then for each step s:

    batch   = the examples at batch_indices(s)                 (whole batch, on every rank)
    own     = batch[rank::ranks], cut into micro batches of whole examples (``micro``)
    loss    = sum over micro batches of objective.loss(...)    (normalised by the whole batch)
    backward per micro batch, the last one the accumulation boundary; one optimizer update

Every rank runs as many micro batches (a rank with fewer adds fillers whose loss is multiplied
by 0: their forward and backward keep ZeRO's collectives in step), and each rank's loss is
multiplied by the number of ranks, as DeepSpeed averages the ranks' gradients. One optimizer
update per step: ``training.steps`` is the schedule's length.

Evaluation (``evaluation``) runs before the first step (``eval.before``), every
``eval.every_steps`` and after the last; checkpoints (``state``) every ``checkpoint.every_steps``
and at the last step; the final model goes to ``RUN_DIR/final`` (``asyncrl export``). A rank
process of a multi-rank run is ``python -m asyncrl.learner.offline.loop RUN_DIR [--resume]``,
started by ``asyncrl.fleet.offline_ranks`` with the same rendezvous as RL's learner ranks.
"""

from __future__ import annotations

import functools
import logging
import random
import sys
import time
from pathlib import Path

import torch

from asyncrl.learner.adapter import save_lora_final
from asyncrl.learner.data_parallel import DataParallel
from asyncrl.learner.deepspeed_setup import deepspeed_engine, init_learner_group, optimizer_update, set_scheduled_lr
from asyncrl.learner.hf_export import save_pretrained
from asyncrl.learner.offline.config import OfflineConfig
from asyncrl.learner.offline.data import ADDITION, ChatRenderer, Example, build_examples, load_rows, write_rows
from asyncrl.learner.offline.evaluation import exact_match
from asyncrl.learner.offline.micro import cut_micro_batches, score_micro
from asyncrl.learner.offline.objective import DPOObjective, make_objective
from asyncrl.learner.offline.reference import cached_reference, fingerprint
from asyncrl.learner.offline.report import OfflineReport
from asyncrl.learner.offline.state import load_checkpoint, save_checkpoint
from asyncrl.learner.offload import adamw_optimizer
from asyncrl.learner.partitioned_load import build_causal_lm
from asyncrl.models.lora import apply_lora, trainable_parameters
from asyncrl.models.precision import resolve_trainer_dtype
from asyncrl.tasks.formatting import load_tokenizer

log = logging.getLogger("asyncrl")


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The examples' order in ``epoch``: a permutation seeded by (seed, epoch)."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The examples of step ``step`` (0-based): positions step*B .. step*B + B - 1 of the epochs
    laid end to end, a pure function of its arguments (a resume needs no cursor)."""
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(position, n)
        out.append(epoch_order(n, seed, epoch)[index])
    return out


class OfflineLoop:
    def __init__(self, cfg: OfflineConfig, run_dir: Path, model_dir: Path):
        import torch._dynamo  # noqa: F401  (before DeepSpeed's ZeRO-3 patches module construction)
        from transformers import AutoConfig

        self.cfg, self.run_dir, self.model_dir = cfg, Path(run_dir), Path(model_dir)
        self.trainer_cfg = cfg.trainer_config()
        self.trainer_cfg = self.trainer_cfg.model_copy(update={"dtype": resolve_trainer_dtype(self.trainer_cfg.dtype)})
        init_learner_group(self.trainer_cfg.collective_timeout_s)
        self.dp = DataParallel.of_process(self.trainer_cfg.collective_timeout_s)
        if self.dp.world != cfg.training.ranks:
            raise ValueError(f"training.ranks ({cfg.training.ranks}) but {self.dp.world} processes joined the group")
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = load_tokenizer(self.model_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.objective = make_objective(cfg.objective)
        pairs = cfg.objective.kind == "dpo"
        train_rows, test_rows = load_rows(cfg.data, cfg.run.seed, pairs)
        if cfg.data.train == ADDITION and self.dp.lead:
            write_rows(train_rows, self.run_dir / "data" / "train.jsonl")
            write_rows(test_rows, self.run_dir / "data" / "test.jsonl")
        renderer = ChatRenderer(self.tokenizer, cfg.data.chat_template)
        self.train = build_examples(train_rows, cfg.data, renderer, pairs, "train")
        self.test = build_examples(test_rows, cfg.data, renderer, pairs, "test")
        self.task = cfg.eval.task or ("addition" if cfg.data.train == ADDITION else "gsm8k")

        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        model = build_causal_lm(self.model_dir, self.trainer_cfg)  # ZeRO-3: partitioned from the start
        model.config.use_cache = False
        if self.trainer_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = cfg.model.lora
        if self.lora is not None:
            model = apply_lora(model, self.lora)  # base frozen, adapters trainable
        model.train()
        params = trainable_parameters(model)  # all of them, or with LoRA the adapters alone
        optimizer = adamw_optimizer(params, self.trainer_cfg, self.trainer_cfg.lr, self.trainer_cfg.weight_decay)
        self.engine = deepspeed_engine(model, optimizer, self.trainer_cfg)
        self.step, self.updates = 0, 0
        set_scheduled_lr(self.engine, self.trainer_cfg, 0)
        self.report = OfflineReport(cfg, self.run_dir) if self.dp.lead else None

    # -----------------------------------------------------------------------------------------

    def passes(self, examples: list[Example], grad: bool) -> dict[str, float]:
        """The objective over ``examples`` (this rank's share), its backward when ``grad``; the
        whole batch's figures (summed over micro batches and ranks) with "loss"."""
        cfg = self.trainer_cfg
        own = examples[self.dp.rank :: self.dp.world]
        micros = cut_micro_batches(own, cfg.micro_batch_size, cfg.micro_batch_tokens)
        longest = max(self.dp.all_gather(len(micros), "micro batches", self.step))
        fillers = longest - len(micros)
        micros += [examples[:1]] * fillers
        normaliser = self.objective.normaliser(examples)
        sums: dict[str, float] = {}
        with self.dp.collective("offline step" if grad else "offline evaluation", self.step):
            for index, micro in enumerate(micros):
                filler = index >= len(micros) - fillers
                if grad:
                    self.engine.set_gradient_accumulation_boundary(index == len(micros) - 1)
                with torch.set_grad_enabled(grad):
                    logprobs = score_micro(
                        self.engine,
                        micro,
                        self.tokenizer.pad_token_id,
                        cfg.micro_batch_tokens is not None,
                        cfg.logits_chunk_tokens,
                    )
                    loss, figures = self.objective.loss(micro, logprobs, normaliser)
                if grad:
                    scale = 0.0 if filler else float(self.dp.world)
                    self.engine.backward(loss * scale, scale_wrt_gas=False)
                if not filler:
                    for key, value in {"loss": float(loss.detach()), **figures}.items():
                        sums[key] = sums.get(key, 0.0) + value
        totals: dict[str, float] = {}
        for part in self.dp.all_gather(sums, "figures", self.step):
            for key, value in part.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def reference(self) -> None:
        """DPO: the starting model's log-probabilities of every pair, computed once (``reference``)."""
        objective = self.objective
        if not isinstance(objective, DPOObjective):
            return
        examples = self.train + self.test

        def compute() -> dict[str, tuple[float, float]]:
            own = examples[self.dp.rank :: self.dp.world]
            micros = cut_micro_batches(own, self.trainer_cfg.micro_batch_size, self.trainer_cfg.micro_batch_tokens)
            longest = max(self.dp.all_gather(len(micros), "reference micro batches", 0))
            micros += [[]] * (longest - len(micros))
            values = {}
            self.engine.eval()
            with torch.no_grad(), self.dp.collective("reference log-probabilities", 0):
                for micro in micros:
                    batch = micro or examples[:1]  # a filler keeps ZeRO-3's gathers in step
                    logprobs = score_micro(
                        self.engine,
                        batch,
                        self.tokenizer.pad_token_id,
                        self.trainer_cfg.micro_batch_tokens is not None,
                        self.trainer_cfg.logits_chunk_tokens,
                    )
                    for example, seqs in zip(micro, logprobs):
                        values[example.uid] = tuple(float(objective.sequence_logprob(s)) for s in seqs)
            self.engine.train()
            merged = {}
            for part in self.dp.all_gather(values, "reference log-probabilities", 0):
                merged.update(part)
            return merged

        key = fingerprint(self.model_dir, examples, objective.length_normalised)
        started = time.monotonic()
        objective.reference = cached_reference(
            self.run_dir, key, compute, self.dp.lead, lambda: self.dp.barrier("reference written", 0)
        )
        log.info("reference log-probabilities of %d pairs: %.1f s", len(examples), time.monotonic() - started)

    def evaluate(self) -> dict:
        """Held-out figures at the current step: the objective's (``eval_*``) and exact match."""
        self.engine.eval()
        figures = self.passes(self.test, grad=False)
        self.engine.train()
        record = {"step": self.step, **{f"eval_{k}": v for k, v in figures.items() if k != "tokens"}}
        if self.cfg.eval.num_prompts:
            match = exact_match(
                self.engine.module,
                self.tokenizer,
                self.test[: self.cfg.eval.num_prompts],
                self.task,
                self.cfg.eval.max_new_tokens,
                self.cfg.eval.batch_size,
            )
            record["exact_match"] = match["exact_match"]
            record["answers"] = match["answers"]
        if self.report is not None:
            self.report.eval(record)
        return record

    def train_step(self) -> dict:
        started = time.monotonic()
        batch = [
            self.train[i]
            for i in batch_indices(len(self.train), self.cfg.training.batch_size, self.cfg.run.seed, self.step)
        ]
        self.engine.train()
        figures = self.passes(batch, grad=True)
        lr, grad_norm = optimizer_update(self.engine, self.trainer_cfg, self.updates)
        self.updates += 1
        self.step += 1
        return {"step": self.step, **figures, "lr": lr, "grad_norm": grad_norm, "step_s": time.monotonic() - started}

    def run(self, resume: bool = False) -> dict:
        """Train ``training.steps`` steps (from the newest checkpoint with ``resume``); the summary."""
        started = time.monotonic()
        self.reference()  # before a checkpoint is loaded: the starting weights are the reference
        before = None
        if resume:
            self.step, self.updates = load_checkpoint(self.engine, self.run_dir, self.dp, self.lora is not None)
            set_scheduled_lr(self.engine, self.trainer_cfg, self.updates)
            log.info("resumed at step %d", self.step)
        if self.step == 0 and self.cfg.eval.before:
            before = self.evaluate()
        every_eval, every_ckpt = self.cfg.eval.every_steps, self.cfg.checkpoint.every_steps
        total = self.cfg.training.steps
        while self.step < total:
            record = self.train_step()
            if self.report is not None:
                self.report.step(record)
            if every_ckpt and (self.step % every_ckpt == 0 or self.step == total):
                save_checkpoint(
                    self.engine,
                    self.run_dir,
                    self.step,
                    self.updates,
                    self.cfg.checkpoint.keep_last,
                    self.dp,
                    self.lora is not None,
                )
            if every_eval and self.step % every_eval == 0 and self.step != total:
                self.evaluate()
        after = self.evaluate()
        if self.lora is not None:  # the merged model, and the adapter in final/adapter
            save_lora_final(self.engine.module, self.lora, self.model_dir, self.run_dir / "final")
        else:
            save_pretrained(
                self.engine.module, self.trainer_cfg.zero_stage, self.hf_config, self.model_dir, self.run_dir / "final"
            )
        if self.dp.lead:
            self.tokenizer.save_pretrained(self.run_dir / "final")
        summary = {
            "objective": self.cfg.objective.kind,
            "steps": self.step,
            "seconds": round(time.monotonic() - started, 1),
            "train_examples": len(self.train),
            "test_examples": len(self.test),
            "before": _figures(before),
            "after": _figures(after),
            "final": str(self.run_dir / "final"),
        }
        if self.report is not None:
            self.report.close(summary)
        self.dp.barrier("run finished", self.step)
        return summary


def _figures(record: dict | None) -> dict | None:
    return None if record is None else {k: v for k, v in record.items() if k != "answers"}


def main(argv: list[str]) -> int:
    """One rank of a multi-rank run: ``python -m asyncrl.learner.offline.loop RUN_DIR [--resume]``."""
    from asyncrl.learner.offline.prepare import resume_offline_config, starting_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    run_dir = Path(argv[0])
    cfg = resume_offline_config(run_dir, [])
    OfflineLoop(cfg, run_dir, starting_model(cfg, run_dir, build=False)).run(resume="--resume" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
