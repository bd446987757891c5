"""MkDocs hook: the reference pages generated from the code, and the checks that keep the docs true.

Generated at build time (never committed, so they cannot go stale):

- ``reference/config.md``: every config key, its type, default and doc (``configref``);
- ``reference/cli.md``: every ``asyncrl`` command's ``--help`` (``cliref``);
- ``reference/recipes.md``: the recipes in ``configs/``, each with its header comment;
- ``benchmarks.md``: ``bench/README.md``, the measured figures, as one page of the site;
- in ``reference/metrics.md``, the table of every metric, from the processes' registry (``metricsref``),
  and the table of a learner step's statistics, from ``StepStats`` (``statsref``).

Every page, README.md too, is checked (``checks``): config keys, YAML config blocks, repository
paths and module names must exist. Problems are logged as warnings, so ``mkdocs build --strict``
(what ``tests/test_docs.py`` runs) fails on them.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import checks
import cliref
import configref
import metricsref
import statsref
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.reference")
ROOT = Path(__file__).resolve().parents[2]
# Document the checkout being built, not whatever copy of asyncrl the environment installed.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def recipes_page() -> str:
    lines = [
        "# Recipes",
        "",
        "The YAML recipes in `configs/`, generated from the files when the site is built. Run one with",
        "`asyncrl train configs/NAME.yaml [dotted.key=value ...]`; every key is in the",
        "[configuration reference](config.md). The header comment of each file says what it is for.",
        "",
    ]
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        header = []
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            header.append(line.lstrip("#").strip())
        lines += [f"## `configs/{path.name}`", ""]
        lines += [" ".join(header), ""] if header else []
        lines += ['??? note "the whole file"', "", "    ```yaml"]
        lines += [f"    {line}" if line else "" for line in text.rstrip().splitlines()]
        lines += ["    ```", ""]
    dashboards = sorted((ROOT / "configs").rglob("*.json"))
    if dashboards:
        lines += ["## Dashboards", ""]
        lines += [
            f"- `{p.relative_to(ROOT)}`: import into Grafana ([Monitoring](../how-to/monitoring.md))."
            for p in dashboards
        ]
        lines.append("")
    return "\n".join(lines) + "\n"


def benchmarks_page() -> str:
    text = (ROOT / "bench" / "README.md").read_text()
    intro = (
        "!!! note\n    This page is `bench/README.md`, rendered into the site when it is built. How to run the"
        " benchmarks: [Benchmarking](how-to/benchmarking.md).\n\n"
    )
    title, _, rest = text.partition("\n")
    return f"{title}\n\n{intro}{rest}"


GENERATED = {
    "reference/config.md": configref.render,
    "reference/cli.md": cliref.render,
    "reference/recipes.md": recipes_page,
    "benchmarks.md": benchmarks_page,
}


def on_files(files, config):
    for uri, render in GENERATED.items():
        files.append(File.generated(config, uri, content=render()))
    return files


@functools.cache
def config_keys() -> tuple[set[str], set[str]]:
    return configref.config_keys()


OFFLINE_SECTIONS = {"data", "training", "objective"}
"""Top-level sections only an ``asyncrl sft``/``dpo`` recipe (``OfflineConfig``) has."""


def validate_recipe(data: dict) -> None:
    """A YAML block of a recipe: an ``OfflineConfig`` when it has a section only those have, else a ``RunConfig``."""
    from asyncrl.config import RunConfig
    from asyncrl.learner.offline.config import OfflineConfig

    if set(data) & OFFLINE_SECTIONS:
        OfflineConfig(**data)
    else:
        RunConfig(**data)


def problems(markdown: str) -> list[str]:

    keys, open_keys = config_keys()
    sections = {k for k in keys if "." not in k}
    found = [f"config key `{k}` is not in RunConfig" for k in checks.unknown_config_keys(markdown, keys, open_keys)]
    found += checks.invalid_yaml_blocks(markdown, sections, validate_recipe)
    found += [f"`{p}` does not exist in the repository" for p in checks.missing_repo_paths(markdown, ROOT)]
    return found


EVERY_METRIC = "<!-- every metric: generated from the registry when the site is built -->"
EVERY_STEP_STAT = "<!-- every step statistic: generated from StepStats when the site is built -->"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri in ("reference/config.md", "reference/cli.md"):
        return markdown  # generated from the code itself
    if EVERY_METRIC in markdown:
        markdown = markdown.replace(EVERY_METRIC, metricsref.render())
    if EVERY_STEP_STAT in markdown:
        markdown = markdown.replace(EVERY_STEP_STAT, statsref.render())
    for problem in problems(markdown):
        log.warning(f"{page.file.src_uri}: {problem}")
    return markdown


def on_post_build(config):
    for problem in problems((ROOT / "README.md").read_text()):
        log.warning(f"README.md: {problem}")
