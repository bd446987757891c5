"""The configuration reference, generated from the config classes' own field docs.

``RunConfig`` (``asyncrl.config``) is walked by type, not by instance, so optional sections
(``algorithm.critic``, ``simulation.generator``) and the items of lists (``reward.rewards``) are
documented even though the defaults leave them empty. ``config_keys()`` is the set of dotted keys a
config accepts; the docs build checks every key a page mentions against it.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass
class Key:
    path: str  # dotted, e.g. "learner.trainer.lr"; list items as "reward.rewards[]"
    type_text: str
    default: str
    doc: str
    any_subkey: bool  # a dict field: any dotted continuation is a valid key


@dataclass
class Section:
    path: str
    doc: str
    model: type[BaseModel]
    keys: list[Key]


def models_in(annotation) -> list[type[BaseModel]]:
    """The config classes an annotation holds (``X``, ``X | None``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def is_list(annotation) -> bool:
    return typing.get_origin(annotation) is list


def is_dict(annotation) -> bool:
    origin = typing.get_origin(annotation)
    return (
        annotation is dict
        or origin is dict
        or (origin in (typing.Union, types.UnionType) and any(is_dict(arg) for arg in typing.get_args(annotation)))
    )


def type_text(annotation) -> str:
    """A short readable type: ``'a' | 'b'`` for literals, ``int | None``, ``list[str]``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if annotation is type(None):
        return "None"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def bounds_text(field) -> str:
    """``≥ 1``, ``> 0, ≤ 60``: the numeric bounds pydantic enforces on a field."""
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts = []
    for item in field.metadata:
        for attr, sign in signs.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
    return ", ".join(parts)


def default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return json.dumps(value, default=plain, ensure_ascii=False)


def plain(value):
    """JSON for what ``json`` cannot write itself: configs (also inside lists), enums, the rest as text."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


def markdown_doc(text: str | None) -> str:
    """A field docstring as one line of Markdown: reST ````code```` becomes ```code```."""
    return " ".join((text or "").replace("``", "`").split())


def walk(model: type[BaseModel], path: str, doc: str, sections: list[Section]) -> None:
    """Append the section at ``path`` and, after it, every section nested in it."""
    section = Section(path, doc, model, [])
    sections.append(section)
    nested = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        inner = models_in(field.annotation)
        if inner and not is_dict(field.annotation):
            for sub in inner:
                if is_list(field.annotation):
                    nested.append((sub, f"{key}[]", f"Each item of `{key}`: {markdown_doc(field.description)}"))
                elif type(None) in typing.get_args(field.annotation):
                    nested.append((sub, key, f"Off unless set (default null). {markdown_doc(field.description)}"))
                else:
                    nested.append((sub, key, markdown_doc(field.description)))
            if not is_list(field.annotation) and type(None) not in typing.get_args(field.annotation):
                continue  # a plain subsection: documented as its own section below
        bounds = bounds_text(field)
        section.keys.append(
            Key(
                path=key,
                type_text=type_text(field.annotation) + (f" ({bounds})" if bounds else ""),
                default=default_text(field),
                doc=markdown_doc(field.description),
                any_subkey=is_dict(field.annotation),
            )
        )
    for sub, key, sub_doc in nested:
        walk(sub, key, sub_doc, sections)


def run_config_sections() -> list[Section]:
    from asyncrl.config import RunConfig

    sections: list[Section] = []
    for name, field in RunConfig.model_fields.items():
        (model,) = models_in(field.annotation)
        walk(model, name, markdown_doc(field.description), sections)
    return sections


def offline_config_sections() -> list[Section]:
    """The sections of ``asyncrl sft``/``asyncrl dpo`` recipes (``OfflineConfig``), whose keys the
    how-to pages of those commands name."""
    from asyncrl.learner.offline.config import OfflineConfig

    sections: list[Section] = []
    for name, field in OfflineConfig.model_fields.items():
        (model,) = models_in(field.annotation)
        walk(model, name, markdown_doc(field.description), sections)
    return sections


def reward_option_sections() -> list[Section]:
    """The ``options`` of the reward kinds that take any: each kind validates them with its class."""
    from asyncrl.rewards.function import PythonRewardConfig
    from asyncrl.rewards.judge import JsonScorerConfig, JudgeConfig
    from asyncrl.rewards.model import RewardModelConfig
    from asyncrl.rewards.teacher import TeacherConfig

    sections: list[Section] = []
    for kind, model in (
        ("http_json", JsonScorerConfig),
        ("openai_judge", JudgeConfig),
        ("reward_model", RewardModelConfig),
        ("python", PythonRewardConfig),
        ("teacher", TeacherConfig),
    ):
        doc = markdown_doc(model.__doc__)
        walk(model, f"reward.rewards[].options ({kind})", doc, sections)
    return sections


def config_keys() -> tuple[set[str], set[str]]:
    """(every valid dotted key and section, the keys under which any subkey is valid)."""
    keys: set[str] = set()
    open_keys: set[str] = set()
    for section in run_config_sections() + offline_config_sections():
        if "[]" in section.path:
            continue  # list items are written in YAML, never as dotted keys
        keys.add(section.path)
        for key in section.keys:
            keys.add(key.path)
            if key.any_subkey:
                open_keys.add(key.path)
    return keys, open_keys


def cell(text: str) -> str:
    """Text for a table cell: pipes escaped outside code spans (inside them they never split a cell)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def render_section(section: Section, level: int) -> list[str]:
    lines = [f"{'#' * level} `{section.path}`", ""]
    if section.doc:
        lines += [section.doc, ""]
    if not section.keys:
        return lines
    lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key in section.keys:
        name = key.path[len(section.path) + 1 :]
        lines.append(f"| `{name}` | `{key.type_text}` | `{key.default}` | {cell(key.doc)} |")
    lines.append("")
    return lines


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated when the site is built, from the field docstrings of `asyncrl.config.RunConfig` and",
        "the section classes it composes, so it always matches the code. The same text, with the values",
        "of a recipe, is printed by `asyncrl show-config [CONFIG] [overrides ...]`.",
        "",
        "A config is a YAML recipe (see [Recipes](recipes.md)) plus dotted overrides on the command line",
        "(`asyncrl train configs/demo.yaml learner.total_steps=20`). Every section below is a YAML",
        "mapping of that name; a key is written `section.key` as an override. Unknown keys and values",
        "outside a field's type or bounds stop the run before it starts, naming the key, the value and",
        "the rule.",
        "",
    ]
    for section in run_config_sections():
        level = 2 if "." not in section.path else 3
        lines += render_section(section, level)
    lines += [
        "## Reward options by kind",
        "",
        "`reward.rewards[].options` is a mapping checked, when the config is read, by the class of the",
        "reward's `kind`: `http_json` and `openai_judge` share the HTTP client's keys, `reward_model`",
        "and `python` have their own. The rule rewards take theirs as keyword arguments: `format` takes `pattern` (a",
        "regex searched in the answer; default: a final `#### number`) and `value` (the reward of a",
        "match, default 1.0), `math_verify` takes `timeout_s` (default 5.0), `exact_match` takes none.",
        "",
    ]
    for section in reward_option_sections():
        lines += render_section(section, 3)
    return "\n".join(lines) + "\n"
