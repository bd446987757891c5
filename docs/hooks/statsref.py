"""The table of a learner step's statistics, generated from ``StepStats``: each field, its type and
the docstring under it (read from the module's source: a struct's field docstrings are not kept at
run time)."""

from __future__ import annotations

import ast
import inspect


def stat_rows() -> list[tuple[str, str, str]]:
    """(name, type, doc) of every ``StepStats`` field, in declaration order."""
    from asyncrl.observability import step_stats

    tree = ast.parse(inspect.getsource(step_stats))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepStats")
    rows, body = [], cls.body
    for node, after in zip(body, [*body[1:], None]):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        if name not in step_stats.StepStats.__struct_fields__:
            continue  # a ClassVar
        doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
        rows.append((name, ast.unparse(node.annotation), " ".join(str(doc).split())))
    return rows


def render() -> str:
    lines = ["| statistic | type | what |", "| --- | --- | --- |"]
    pipe = "\\|"
    lines += [
        f"| `{name}` | `{kind.replace('|', pipe)}` | {doc.replace('|', pipe)} |" for name, kind, doc in stat_rows()
    ]
    return "\n".join(lines) + "\n"
