"""What the model writes: a share of each learner step's answers in ``RUN_DIR/samples.jsonl``.

The learner picks ``logging.samples_per_step`` groups of each batch it trains on and sends their
answers (text cut to ``logging.samples_max_chars``, rewards and reward parts, versions,
staleness) in a ``samples`` event; the controller hands them to ``SamplesLog``, which appends one
JSON line per answer and puts the step's share on TensorBoard's text tab. Picked by the learner,
because it alone sees an answer with its reward *and* the version that trained on it (the
staleness); whole groups, because a reward means something only beside its group's others.

Bounded: a step adds at most groups x n lines of at most ~2 x ``samples_max_chars`` characters
each; when the file reaches ``logging.samples_max_bytes`` it becomes ``samples.1.jsonl`` (the
previous one is dropped) and a new file starts, so a run of any length keeps at most twice that,
the newest lines always in ``samples.jsonl``. ``asyncrl inspect RUN --samples [N]`` prints the
last N answers, grouped by prompt (``read_last``, ``format_samples``).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

FILE = "samples.jsonl"
ROTATED = "samples.1.jsonl"


def cut(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its start and '…' (``max_chars`` in all)."""
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class SamplesLog:
    """Appends sample records to ``run_dir/samples.jsonl``, rotating it at ``max_bytes``."""

    def __init__(self, run_dir: Path, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes ({max_bytes}) must be >= 1")
        self.path = Path(run_dir) / FILE
        self.max_bytes = max_bytes
        self.size = self.path.stat().st_size if self.path.exists() else 0

    def write(self, records: list[dict]) -> None:
        """One line per record; the file is rotated first when these lines would pass ``max_bytes``."""
        if not records:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        size = len(text.encode())
        if self.size and self.size + size > self.max_bytes:
            self.path.replace(self.path.with_name(ROTATED))
            self.size = 0
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
        self.size += size


def samples_markdown(records: list[dict]) -> str:
    """A step's records as Markdown for TensorBoard's text tab: each prompt once, then its answers."""
    parts = []
    for group_id, group in _by_group(records):
        first = group[0]
        parts.append(f"**{group_id}** ({first['task']}, `{first['prompt_uid']}`), reference: `{first['answer']}`\n")
        parts.append("```\n" + first["prompt"].replace("```", "'''") + "\n```\n")
        for r in group:
            parts.append(
                f"- reward {_number(r['reward'])} {_parts(r)}· version {r['policy_version']} · staleness "
                f"{r['staleness']} · {r['tokens']} tokens, {r['finish_reason']}\n\n"
                "  ```\n  " + r["completion"].replace("```", "'''").replace("\n", "\n  ") + "\n  ```\n"
            )
    return "\n".join(parts)


def read_last(run_dir: Path, n: int) -> list[dict]:
    """The last ``n`` records of the run (from the rotated file too when the current one has fewer)."""
    if n < 1:
        raise ValueError(f"n ({n}) must be >= 1")
    last: deque[dict] = deque(maxlen=n)
    for name in (ROTATED, FILE):
        path = Path(run_dir) / name
        if path.exists():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        last.append(json.loads(line))
    return list(last)


def format_samples(records: list[dict]) -> str:
    """Records as a person reads them: a header per prompt, then each answer with its numbers."""
    lines = []
    for group_id, group in _by_group(records):
        first = group[0]
        lines.append(
            f"== step {first['version']} · {group_id} · {first['task']} · {first['prompt_uid']} · "
            f"from {first['generator']}"
        )
        lines.append("prompt:    " + _indent(first["prompt"]))
        lines.append("reference: " + _indent(first["answer"]))
        for r in group:
            lines.append(
                f"-- {r['uid']}: reward {_number(r['reward'])} {_parts(r)}| version {r['policy_version']}, "
                f"staleness {r['staleness']} | {r['tokens']} tokens, {r['finish_reason']}{_episode(r)}"
            )
            lines.append("   " + _indent(r.get("transcript") or r["completion"], "   "))
        lines.append("")
    return "\n".join(lines)


def _by_group(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Consecutive records of one group together, in order (a group's answers are written together)."""
    out: list[tuple[str, list[dict]]] = []
    for r in records:
        key = f"{r['group_id']}@{r['version']}"
        if out and out[-1][0] == key:
            out[-1][1].append(r)
        else:
            out.append((key, [r]))
    return [(key.rsplit("@", 1)[0], group) for key, group in out]


def _episode(record: dict) -> str:
    """A multi-turn episode's figures (nothing for a single answer)."""
    if record.get("turns", 1) == 1 and not record.get("masked_tokens"):
        return ""
    out = f" | {record['turns']} turns, {record.get('masked_tokens', 0)} tokens the environment's"
    if record.get("tool_calls"):
        out += f", {record['tool_calls']} tool calls ({record.get('tool_errors', 0)} failed)"
    if record.get("env_error"):
        out += f", environment failed: {record['env_error']}"
    return out


def _number(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _parts(record: dict) -> str:
    parts = record.get("reward_parts") or {}
    return "(" + ", ".join(f"{k} {_number(v)}" for k, v in parts.items()) + ") " if parts else ""


def _indent(text: str, prefix: str = "           ") -> str:
    return text.replace("\n", "\n" + prefix)
