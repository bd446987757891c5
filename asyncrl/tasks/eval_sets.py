"""Evaluation sets: the task's own held-out split, and any other files scored beside it.

Every round scores the first ``eval.num_prompts`` of the task's test split (the set ``test``: a mix
of sources interleaves their splits, ``asyncrl.tasks.mixture``) and, with ``eval.sets``, each extra
set too, reported under its name. An extra set belongs to one task of the run (``task``: the run's
task, or a source of a mix by name): its prompts carry that task's name, so they are rendered with
its template and scored by its rewards (``reward.by_task``), like its own held-out rows. Its
``data`` takes the task's ``data`` and replaces what it sets, so a set that only names its file
(``data.test``) reads it with the task's keys, template and chat template.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pydantic import Field, field_validator

from asyncrl.configbase import Config
from asyncrl.tasks.mixture import check_task_name
from asyncrl.tasks.sources import DataConfig

MAIN_SET = "test"
"""The name the task's own held-out split is reported under."""


class EvalSetConfig(Config):
    """One extra evaluation set (an entry of ``eval.sets``)."""

    name: str
    """Its name in ``evals.jsonl`` (``sets``), TensorBoard (``eval/NAME/...``) and the log."""
    data: DataConfig
    """Where its rows are (``data.test``: a file, a saved dataset or hf://), over the task's ``data``:
    keys, templates and chat template not given here are the task's."""
    task: str | None = None
    """The task it belongs to (its template and rewards): None is the run's task; with
    ``task.sources``, the name of one source (required)."""
    num_prompts: int = Field(500, ge=1)
    """Its first rows scored in each round."""

    @field_validator("name")
    @classmethod
    def check_name(cls, value: str) -> str:
        if value == MAIN_SET:
            raise ValueError(f"name ({value!r}) is the task's own held-out split's: choose another")
        return check_task_name(value)

    @field_validator("data")
    @classmethod
    def check_data(cls, value: DataConfig) -> DataConfig:
        if value.test is None:
            raise ValueError("data.test (None) must name the set's rows")
        return value


def check_eval_sets(sets: list[EvalSetConfig], task_cfg) -> None:
    """Names distinct, each set's task one of the run's (``task_cfg``: the run's ``TaskConfig``)."""
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"eval.sets names ({names}) must be distinct: each is reported under its name")
    tasks = task_cfg.task_names()
    for s in sets:
        if s.task is None and task_cfg.sources:
            raise ValueError(f"eval.sets {s.name!r}: task (None) must name one of task.sources {tasks}")
        if s.task is not None and s.task not in tasks:
            raise ValueError(f"eval.sets {s.name!r}: task ({s.task!r}) must be a task of this run: {tasks}")


def set_task(eval_set: EvalSetConfig, task_cfg):
    """The ``TaskConfig`` that reads ``eval_set``: its task's, with the set's data over the task's."""
    task = task_cfg
    if eval_set.task is not None and task_cfg.sources:
        task = next(t for t in task_cfg.source_tasks() if t.name == eval_set.task)
    given = {key: getattr(eval_set.data, key) for key in eval_set.data.model_fields_set}
    data = task.data.model_copy(update={**given, "train": None})
    return task.model_copy(update={"data": data, "test_size": eval_set.num_prompts, "sources": []})


def load_eval_prompts(cfg, model_dir: str | Path | None) -> tuple[list, list[str]]:
    """Every prompt a round scores and the set of each (``cfg``: the run's ``RunConfig``): the first
    ``eval.num_prompts`` of the task's test split (``test``), then each of ``eval.sets``, rendered
    and measured as the engines take them (``asyncrl.tasks.prompts.load_run_prompts``)."""
    from asyncrl.tasks.prompts import load_run_prompts

    prompts = load_run_prompts(cfg, "test", model_dir)[: cfg.eval.num_prompts]
    sets = [MAIN_SET] * len(prompts)
    for eval_set in cfg.eval.sets:
        view = cfg.model_copy(update={"task": set_task(eval_set, cfg.task)})
        rows = load_run_prompts(view, "test", model_dir)[: eval_set.num_prompts]
        prompts += [replace(p, prompt_uid=f"{eval_set.name}:{p.prompt_uid}") for p in rows]
        sets += [eval_set.name] * len(rows)
    return prompts, sets
