"""The command-line reference, generated from the ``asyncrl`` parser's own help texts."""

from __future__ import annotations

import argparse
import contextlib
import io
import os


def help_text(argv: list[str]) -> str:
    """What ``asyncrl ARGV --help`` prints, at a fixed width so the page does not depend on the terminal."""
    from asyncrl.cli import main

    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*argv, "--help"])
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip()


def subcommands() -> dict[str, argparse.ArgumentParser]:
    from asyncrl.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def render() -> str:
    lines = [
        "# Command-line reference",
        "",
        "Generated when the site is built from the `asyncrl` parser: each block is exactly what",
        "`asyncrl COMMAND --help` prints. `asyncrl` is installed into `.venv/bin/`; `python -m asyncrl.cli`",
        "is the same program.",
        "",
        "## `asyncrl`",
        "",
        "```text",
        help_text([]),
        "```",
        "",
    ]
    for name in subcommands():
        lines += [f"## `asyncrl {name}`", "", "```text", help_text([name]), "```", ""]
        if name == "bench":
            lines += ["### `asyncrl bench pipeline`", "", "```text", help_text(["bench", "pipeline"]), "```", ""]
        if name == "model":
            lines += ["### `asyncrl model fetch`", "", "```text", help_text(["model", "fetch"]), "```", ""]
    return "\n".join(lines) + "\n"
