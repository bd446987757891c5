"""What the docs build checks in every page, so that the docs cannot drift from the code.

- Config keys in code (``learner.total_steps``, ``weights.transport: zmq``,
  ``run.name=short`` in a shell block) must be keys of ``RunConfig``.
- A YAML block whose top-level keys are config sections must validate as a ``RunConfig``.
- Repository paths in inline code (``asyncrl/weights/``, ``configs/demo.yaml``) and dotted module
  names (``asyncrl.controller.watchdog``) must exist in the checkout.

Each check returns the problems it found as sentences; the hook logs them as warnings, which
``mkdocs build --strict`` turns into a failed build.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.S | re.M
)
# A dotted name not preceded by a path or another name: `a.b`, `a.b.c=1`, `a.b: x`.
DOTTED = re.compile(r"(?<![\w./@:-])([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)")
FILE_SUFFIXES = {
    "py", "json", "jsonl", "yaml", "yml", "md", "png", "txt", "prom", "port", "safetensors",
    "gz", "parquet", "sh", "toml", "key", "pt", "bin", "log",
}  # fmt: skip
REPO_PATH = re.compile(r"^(asyncrl|configs|bench|tests|scripts|docs|data)/[\w./-]*$")
MODULE = re.compile(r"^asyncrl(\.\w+)+$")
# In code blocks (commands, the README's map): paths into the package, and the recipes and scripts
# commands run; not what commands write (bench/results/..., runs/...), which need not exist yet.
BLOCK_PATH = re.compile(r"(?<![\w./-])(asyncrl/[\w./-]*[\w/]|(?:configs|bench)/[\w/-]+\.(?:py|yaml|sh))(?![\w*])")


def split_code(markdown: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(fenced blocks as (info string, body), inline code spans outside them)."""
    blocks = [(m.group("info").strip(), m.group("body")) for m in FENCE.finditer(markdown)]
    prose = FENCE.sub("", markdown)
    spans = [m.group(2).strip() for m in CODE_SPAN.finditer(prose)]
    return blocks, spans


def dotted_keys(text: str, sections: set[str]) -> list[str]:
    """Dotted names in ``text`` whose first part is a config section (file names excluded)."""
    found = []
    for m in DOTTED.finditer(text):
        name = m.group(1)
        parts = name.split(".")
        if parts[0] in sections and parts[-1] not in FILE_SUFFIXES:
            found.append(name)
    return found


def is_key(name: str, keys: set[str], open_keys: set[str]) -> bool:
    if name in keys:
        return True
    parts = name.split(".")
    return any(".".join(parts[:i]) in open_keys for i in range(1, len(parts)))


def unknown_config_keys(markdown: str, keys: set[str], open_keys: set[str]) -> list[str]:
    """Config keys mentioned in code (inline spans, shell and YAML-comment blocks) that the config lacks."""
    sections = {k for k in keys if "." not in k}
    blocks, spans = split_code(markdown)
    texts = spans + [body for info, body in blocks if not info.startswith(("text", "python"))]
    unknown = []
    for text in texts:
        for name in dotted_keys(text, sections):
            if not is_key(name, keys, open_keys) and name not in unknown:
                unknown.append(name)
    return unknown


def invalid_yaml_blocks(markdown: str, sections: set[str], validate) -> list[str]:
    """YAML blocks made of config sections that ``validate`` (``RunConfig(**data)``) refuses."""
    problems = []
    blocks, _ = split_code(markdown)
    for info, body in blocks:
        if not info.startswith(("yaml", "yml")):
            continue
        try:
            data = yaml.safe_load(body)
        except yaml.YAMLError as e:
            problems.append(f"a YAML block does not parse: {e}")
            continue
        if not isinstance(data, dict) or not data or not set(data) <= sections:
            continue
        try:
            validate(data)
        except Exception as e:  # the config's own error names the key and the rule
            first = body.strip().splitlines()[0]
            problems.append(f"the YAML block starting {first!r} is not a valid config: {e}")
    return problems


def module_exists(name: str, root: Path) -> bool:
    """``asyncrl.a.b``: each part a package or module in the checkout; after a module, attributes."""
    path = root
    for part in name.split("."):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            return True
        else:
            return False
    return True


def missing_repo_paths(markdown: str, root: Path) -> list[str]:
    """Repository paths and ``asyncrl.*`` module names in inline code, and paths into ``asyncrl/``,
    ``configs/`` and ``bench/`` in code blocks, that the checkout lacks."""
    blocks, spans = split_code(markdown)
    spans = spans + [m.group(1) for _, body in blocks for m in BLOCK_PATH.finditer(body)]
    missing = []
    for span in spans:
        if REPO_PATH.match(span):
            exists = (root / span.rstrip("/")).exists()
        elif MODULE.match(span):
            exists = module_exists(span, root)
        else:
            continue
        if not exists and span not in missing:
            missing.append(span)
    return missing
