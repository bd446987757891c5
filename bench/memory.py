"""The learner's memory model: predictions, measurements here, the 7 B / 32 B table, publication times.

    .venv/bin/python bench/memory.py predict --shape qwen2.5-7b --ranks 8 --zero-stage 3 --seq-len 8192
    flock /tmp/asyncrl-heavy.lock .venv/bin/python bench/memory.py measure \
        --shape bench-0.1b --zero-stage 2 --ranks 2 --out bench/results/memory_measured.json
    .venv/bin/python bench/memory.py table         # -> bench/results/memory_table.json
    .venv/bin/python bench/memory.py publication   # -> bench/results/memory_publication.json

``measured`` redoes the stored runs' predictions with the model as it is now (the measured
figures stay) and prints them as a markdown table. ``predict`` prints ``asyncrl.benchmarks.memory_model.predict_dict`` for one shape and setup (a
named shape, ``NAME@vocabN``, or a path to a Hugging Face config.json). ``measure`` starts the
ranks on a randomly initialised Qwen2 of the shape (``asyncrl.benchmarks.memory_measure``),
takes learner steps and appends the measured peak beside the predicted one to ``--out`` (one
entry per run, replacing an entry of the same shape and setup). ``table`` searches the largest
micro batch and sequence length that fit 7 B and 32 B on 8 GPUs of 80 and 141 GB
(``asyncrl.benchmarks.memory_table``); ``publication`` fits the publication time model to the
figures in ``bench/results`` and extrapolates it (``asyncrl.benchmarks.publication_model``).
One JSON object on stdout for each.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "cuda" not in sys.argv:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.benchmarks.memory_model import LearnerSetup, predict_dict  # noqa: E402
from asyncrl.benchmarks.model_shapes import shape  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def setup_arguments(parser: argparse.ArgumentParser, defaults: LearnerSetup) -> None:
    """One option per ``LearnerSetup`` field, defaulting to ``defaults``."""
    from dataclasses import fields

    for f in fields(LearnerSetup):
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=value, metavar="BOOL")
        elif f.name == "bucket_elements":
            parser.add_argument(flag, type=lambda s: None if s == "none" else int(float(s)), default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)


def setup_of(args) -> LearnerSetup:
    from dataclasses import fields

    return LearnerSetup(**{f.name: getattr(args, f.name) for f in fields(LearnerSetup)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="the predicted peak of one rank")
    p.add_argument("--shape", default="qwen2.5-7b")
    setup_arguments(p, LearnerSetup())
    from asyncrl.benchmarks.memory_measure import quick_setup

    m = sub.add_parser("measure", help="measured against predicted, here (CPU: device = host)")
    m.add_argument("--shape", default="bench-0.1b")
    m.add_argument("--steps", type=int, default=2, help="learner steps (the first allocates AdamW's moments)")
    m.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, the CUDA allocator's peak"
    )
    m.add_argument("--out", type=Path, default=RESULTS / "memory_measured.json")
    setup_arguments(m, quick_setup())
    r = sub.add_parser("measured", help="the measured runs' predictions redone by the model as it is, as markdown")
    r.add_argument("--out", type=Path, default=RESULTS / "memory_measured.json")
    t = sub.add_parser("table", help="7 B and 32 B on 8 GPUs of 80 and 141 GB")
    t.add_argument("--out", type=Path, default=RESULTS / "memory_table.json")
    u = sub.add_parser("publication", help="publication time: fit here, extrapolated")
    u.add_argument("--out", type=Path, default=RESULTS / "memory_publication.json")
    args = parser.parse_args()

    if args.command == "predict":
        print(json.dumps(predict_dict(shape(args.shape), setup_of(args)), indent=2))
    elif args.command == "measure":
        measure_command(args)
    elif args.command == "measured":
        from asyncrl.benchmarks.memory_measure import measured_markdown, repredict

        report = json.loads(args.out.read_text())
        report["runs"] = [repredict(run) for run in report["runs"]]
        write(args.out, report, quiet=True)
        print(measured_markdown(report["runs"]))
    elif args.command == "table":
        from asyncrl.benchmarks.memory_table import table

        write(args.out, table())
    else:
        from asyncrl.benchmarks.publication_model import publication_report

        write(args.out, publication_report(RESULTS))


def measure_command(args) -> None:
    from asyncrl.benchmarks.memory_measure import measure
    from asyncrl.benchmarks.provenance import measured_commit

    result = measure(shape(args.shape), setup_of(args), steps=args.steps, device=args.device)
    result["load_average"] = os.getloadavg()
    result["commit"] = measured_commit()
    if args.device == "cpu":
        result["machine"] = "2-core CPU, 24 GiB, shared (device = host)"
    print(json.dumps({k: v for k, v in result.items() if k not in ("predicted", "ranks")}, indent=2))
    runs = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    runs = [r for r in runs if (r["shape"], r["setup"]) != (result["shape"], result["setup"])] + [result]
    write(
        args.out,
        {"note": "CPU: peak RSS over the process's baseline (asyncrl.benchmarks.memory_measure)", "runs": runs},
        quiet=True,
    )


def write(path: Path, report: dict, quiet: bool = False) -> None:
    text = json.dumps(report, indent=2)
    if not quiet:
        print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


if __name__ == "__main__":
    main()
