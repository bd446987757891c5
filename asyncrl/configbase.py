"""The base of every config class, and YAML + dotted-override loading.

Each component owns its config next to its code (``BufferConfig`` in ``asyncrl/buffer``...);
``asyncrl.config.RunConfig`` composes them. Every field carries a docstring (pydantic reads it
as the field's description, so ``asyncrl train --help-config`` can print it), has a default
that works, and unknown keys are errors that name the key.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict


class UserError(Exception):
    """A mistake in what the user gave: a recipe or data file that is missing or malformed, a
    model folder that is not a model, a registry that cannot be reached.

    Raised where the input is checked, with a message of one line that names the thing and the
    fix; ``asyncrl`` prints that line and exits 2 without a traceback (``--debug`` shows it), as it
    does for a bad config key. Anything else that goes wrong is a bug and keeps its traceback.
    Subclasses that are also a built-in error (``UserFileError``) keep ``except`` clauses and
    tests that expect the built-in working.
    """


class UserFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist."""


class UserValueError(UserError, ValueError):
    """A file the user gave exists but its content breaks a rule (a row that is not JSON...)."""


class UserKeyError(UserError, KeyError):
    """A file the user gave lacks something the config names (a column, a split)."""


class UserConnectionError(UserError, ConnectionError):
    """Something the input needs is on a server out of reach (a package index, the Hugging Face Hub)."""


class Config(BaseModel):
    """Base for config classes: typos are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"buffer.capacity=512"`` -> (["buffer", "capacity"], 512); the value is parsed as YAML."""
    if "=" not in text:
        raise UserValueError(f"override {text!r} must look like dotted.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise UserValueError(f"override key {key!r} must be a dotted path like learner.lr")
    return key.split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each dotted key in a nested dict (in place) and return it."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserValueError(f"override {text!r}: {part!r} is a value ({child!r}), not a section")
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    """Read a YAML recipe; an empty file is an empty dict."""
    if not Path(path).is_file():
        where = "is a folder" if Path(path).is_dir() else f"does not exist (from {Path.cwd()})"
        raise UserFileError(f"recipe {path} {where}: give a YAML file, e.g. configs/demo.yaml")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or " ".join(str(e).split())
        raise UserValueError(f"recipe {path} is not valid YAML{where}: {why}") from e
    if not isinstance(data, dict):
        raise UserValueError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def import_class(path: str, key: str) -> type:
    """The class a config value names, ``module:Class``; a ValueError names ``key``, the value and
    the rule."""
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{key} ({path!r}) must be 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key} ({path!r}): cannot import {module_name}: {e}") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{key} ({path!r}): {module_name} has no class {name}")
    return cls
