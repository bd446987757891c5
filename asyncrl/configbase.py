"""The base of every config class, and YAML + dotted-override loading.

Each component owns its config next to its code (``BufferConfig`` in ``asyncrl/buffer``...);
``asyncrl.config.RunConfig`` composes them. Every field carries a docstring (pydantic reads it
as the field's description, so ``asyncrl train --help-config`` can print it), has a default
that works, and unknown keys are errors that name the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict


class Config(BaseModel):
    """Base for config classes: typos are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"buffer.capacity=512"`` -> (["buffer", "capacity"], 512); the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like dotted.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"override key {key!r} must be a dotted path like learner.lr")
    return key.split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each dotted key in a nested dict (in place) and return it."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {text!r}: {part!r} is a value ({child!r}), not a section")
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    """Read a YAML recipe; an empty file is an empty dict."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data
